"""The CPU profiling script's arithmetic (simulator/profiling/cpu_tiny.py), on made-up points
from known coefficients: what it writes must parse as a profile and give those coefficients
back. Measuring the real deployment is what benchmarks/sim_validation.py runs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from disagg_sim.profile import parse_profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "simulator" / "profiling"))
from cpu_tiny import build_profile, store_loads  # noqa: E402

BYTES_PER_TOKEN = 2304


def test_the_profile_gives_back_the_coefficients_its_points_were_made_from() -> None:
    def prefill_s(n: int) -> float:
        return 0.02 + 6e-5 * n + 1e-7 * n * n / 2

    def decode_s(batch: int, context: int) -> float:
        return 0.008 + 1.3e-4 * batch + 7e-7 * batch * context

    hand_over = 0.03
    log = "\n".join(
        f"INFO request {i}: loaded {blocks} KV blocks ({blocks * 32 * BYTES_PER_TOKEN} bytes) "
        f"from the store in {1.5 + blocks * 0.1:.1f} ms (in the step)"
        for i, blocks in enumerate([8, 16, 24] * 3))
    points = {
        "prefill": [(n, prefill_s(n)) for n in (32, 128, 256, 512, 768)],
        "decode": [(b, c, decode_s(b, c)) for c in (88, 536) for b in (1, 4, 8, 16)],
        "proxy": [(n, prefill_s(n) + decode_s(1, n) + hand_over) for n in (128, 256, 512, 768)],
        "store": store_loads(log + "\nINFO request 9: stored 3 KV blocks in 1.0 ms"),
    }

    def store_hit_s(cached: int) -> float:  # 16 computed after `cached` loaded, re-read
        return (0.02 + 6e-5 * 16 + 1e-7 * 16 * (cached + 8) + 0.0015 + cached / 32 * 0.0001
                + 1.2e-5 * cached)

    points["store_hits"] = [(c, store_hit_s(c)) for c in (128, 256, 512, 768)]
    assert len(points["store"]) == 9
    profile = parse_profile(build_profile(points, 61.0, BYTES_PER_TOKEN))
    assert profile.prefill.prompt_seconds(768) == pytest.approx(prefill_s(768), rel=0.01)
    assert profile.transfer.latency_s == pytest.approx(hand_over, rel=0.01)
    assert profile.store_load is not None
    # 0.1 ms per 32-token block over 1.5 ms: the fit resolves the per-token term here.
    assert profile.store_load_seconds(512) == pytest.approx(0.0015 + 16 * 0.0001, rel=0.01)
    assert profile.prefill.per_context_token_s == pytest.approx(1.2e-5, rel=0.02)
    assert profile.shared_cores and profile.startup_s == 61.0
