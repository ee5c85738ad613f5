"""The trace replay's ideal of a cluster-wide prefix cache (benchmarks/trace_replay.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from disagg_devtools.benchmark_scripts import load_benchmark

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "trace_replay.py"


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_benchmark("trace_replay")


def two_turns(bench: Any) -> Any:
    """A 4-block prompt, then its next turn: the same 4 blocks and 2 more."""
    first = list(range(100, 132))
    return bench.Replay([first, first + list(range(200, 216))], [0.0, 0.01], 8)


def test_a_next_turn_reuses_its_history_in_the_untimed_ideal(bench: Any) -> None:
    work = two_turns(bench)
    assert work.ideal_computed() == 32 + 16
    assert work.reuse_classes() == ["cold", "part"]


def test_a_turn_sent_before_its_history_came_back_reuses_nothing_of_it(bench: Any) -> None:
    work = two_turns(bench)
    late = bench.Outcome(sent_at={0: 0.0, 1: 0.01}, first_at={0: 0.05, 1: 0.06})
    in_time = bench.Outcome(sent_at={0: 0.0, 1: 0.10}, first_at={0: 0.05, 1: 0.16})
    assert work.ideal_computed(late) == 32 + 48
    assert work.ideal_computed(in_time) == work.ideal_computed()


def test_a_failed_request_stores_nothing_for_the_timed_ideal(bench: Any) -> None:
    work = two_turns(bench)
    failed_first = bench.Outcome(sent_at={0: 0.0, 1: 0.10}, first_at={1: 0.16})
    assert work.ideal_computed(failed_first) == 32 + 48
