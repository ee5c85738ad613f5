"""The kill/freeze benchmark (benchmarks/proxy_failover.py), short: with one of three decode
instances killed or frozen under load, no request fails, started streams included (they are
continued on another instance), no answer differs from the uninterrupted one, under either
routing policy, and no client waits for its first token longer than the first-byte limit plus
one retry. Real proxy process, stand-in backends (processes of their own); the negative control
turns continuation off, and then started streams fail."""

from __future__ import annotations

from types import ModuleType

import pytest
from disagg_devtools.benchmark_scripts import load_benchmark

FIRST_BYTE_LIMIT = 1.0


def benchmark() -> ModuleType:
    return load_benchmark("proxy_failover")


@pytest.mark.parametrize("scenario", ["kill", "freeze"])
@pytest.mark.parametrize("routing", ["round-robin", "least-outstanding"])
def test_one_failed_decode_fails_no_request_and_changes_no_answer(scenario, routing) -> None:
    result = benchmark().run(scenario, routing, seconds=4.0, event_at=1.0, concurrency=8,
                             tokens=8, token_delay=0.02,
                             proxy_args=["--decode-first-byte-timeout", str(FIRST_BYTE_LIMIT),
                                         "--health-interval", "1", "--health-timeout", "0.5"])
    assert len(result.outcomes) > 50  # the load ran, before and after the failure
    assert result.failed == 0, [o.detail for o in result.outcomes if not o.ok]
    assert result.wrong == 0
    assert result.longest_first_token_wait < FIRST_BYTE_LIMIT + 1.0


def test_without_continuation_the_streams_under_way_fail() -> None:
    """The negative control: the proxy that ends a broken stream with an error event."""
    result = benchmark().run("kill", "round-robin", seconds=3.0, event_at=1.0, concurrency=8,
                             tokens=8, token_delay=0.05,
                             proxy_args=["--decode-first-byte-timeout", str(FIRST_BYTE_LIMIT),
                                         "--health-interval", "1", "--health-timeout", "0.5",
                                         "--no-continue-streams"])
    assert result.failed > 0 and result.failed_before_streaming == 0
