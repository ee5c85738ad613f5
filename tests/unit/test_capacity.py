"""The capacity benchmark's arithmetic (benchmarks/capacity.py): where a stack stops meeting its
latency targets, the prefix-aware router of the monolithic stack, the rate scaling."""

from __future__ import annotations

import math
from typing import Any

import pytest
from disagg_devtools.benchmark_scripts import load_benchmark


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_benchmark("capacity")


def point(bench: Any, rate: float, ttft: float, itl: float = 0.01, failed: int = 0) -> Any:
    timings = [bench.Timing(0.0, ttft, [itl] * 4) for _ in range(10 - failed)]
    timings += [bench.Timing(0.0) for _ in range(failed)]
    return bench.Point("s", rate, tuple(timings), 1.0)


TARGETS_DOC = "1 s TTFT, 20 ms ITL"


def targets(bench: Any) -> Any:
    return bench.Targets(1.0, 0.02, TARGETS_DOC)


def test_capacity_is_interpolated_where_the_worse_p90_crosses_its_target(bench: Any) -> None:
    # Slack 0.5 at rate 1, 1.5 at rate 2 (TTFT-bound): it crosses 1 half-way.
    points = [point(bench, 1, 0.5), point(bench, 2, 1.5)]
    assert bench.capacity(points, targets(bench)) == (pytest.approx(1.5), True)
    # The ITL target binds as well: slack 2 at rate 2 crosses at a third of the way.
    points = [point(bench, 1, 0.5), point(bench, 2, 0.5, itl=0.04)]
    assert bench.capacity(points, targets(bench))[0] == pytest.approx(1 + 1 / 3)


def test_capacity_bounds_a_stack_that_never_or_always_misses(bench: Any) -> None:
    assert bench.capacity([point(bench, 1, 0.5), point(bench, 2, 0.9)], targets(bench)) \
        == (2, False)
    assert bench.capacity([point(bench, 1, 3.0)], targets(bench)) == (0.0, False)


def test_a_failed_request_misses_the_targets(bench: Any) -> None:
    missed = point(bench, 2, 0.1, failed=1)
    assert missed.slack(targets(bench)) == math.inf
    assert missed.within(targets(bench)) == pytest.approx(0.9)
    assert bench.capacity([point(bench, 1, 0.5), missed], targets(bench))[0] \
        == pytest.approx(1.0)


def test_within_counts_each_request_against_both_targets(bench: Any) -> None:
    timings = (bench.Timing(0.0, 0.5, [0.01] * 9), bench.Timing(0.0, 1.5, [0.01] * 9),
               bench.Timing(0.0, 0.5, [0.01] * 5 + [0.5] * 4))
    assert bench.Point("s", 1, timings, 1.0).within(targets(bench)) == pytest.approx(1 / 3)


def test_the_router_keeps_a_conversation_where_its_prefix_was_served(bench: Any) -> None:
    router = bench.PrefixAffinityRouter(["a", "b"], block=4)
    first, other = list(range(8)), list(range(100, 108))
    with router.route(first) as where_first, router.route(other) as where_other:
        assert where_first != where_other  # the less busy one for a new prefix
    with router.route(first + [9, 9, 9, 9]) as next_turn:
        assert next_turn == where_first
    with router.route(other[:4] + [1, 1, 1, 1]) as shares_one_block:
        assert shares_one_block == where_other


def test_the_router_spills_a_prefix_to_the_idle_instance_past_the_imbalance(bench: Any) -> None:
    router = bench.PrefixAffinityRouter(["a", "b"], block=4, balance=1)
    prompt = list(range(8))
    with router.route(prompt) as home, router.route(prompt) as again:
        assert again == home  # busy 1 vs 0: within the balance
        with router.route(prompt) as spilled:
            assert spilled != home  # busy 2 vs 0


def test_arrivals_keep_the_trace_spacing_at_the_asked_mean_rate(bench: Any) -> None:
    work = load_benchmark("trace_replay").Replay([[1]] * 3, [10.0, 11.0, 14.0], 8)
    assert bench.at_rate(work, 2.0) == pytest.approx([0.0, 0.25, 1.0])


def test_the_report_compares_no_two_lower_bounds(bench: Any) -> None:
    both_held = [point(bench, 1, 0.5), point(bench, 2, 0.6)]
    rows = [bench.Point(stack, p.rate, p.timings, 1.0) for stack in ("kvhelper", "reuse-off")
            for p in both_held]
    capacity_rows = bench.report(rows, targets(bench)).split("capacity (req/s)")[1]
    assert ">= 2.00" in capacity_rows and "1.00x" not in capacity_rows
