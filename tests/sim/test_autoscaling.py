"""The planner in the simulator on the whole recorded trace: a small in-CI version of
benchmarks/sim_autoscaling.py that asserts its figures (a few static configurations around
the best instead of the whole sweep)."""

from __future__ import annotations

from pathlib import Path

import pytest
from disagg_operator.planner import Bounds, Targets
from disagg_sim.evaluation import best_static, planner_run, sweep
from disagg_sim.profile import load_profile
from disagg_sim.trace import read_trace, to_requests

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"
TARGETS = Targets(ttft_p90_s=4.0, itl_p90_s=0.05)


@pytest.mark.skipif(not TRACE.exists(), reason="the trace lives in ../shared/traces")
def test_the_planner_on_the_recorded_trace_against_the_best_static_configuration() -> None:
    profile = load_profile("deepseek-v3-h200")
    requests = to_requests(read_trace(TRACE))
    runs = sweep(profile, requests, "store-aware", [(2, 2), (3, 1), (3, 2), (4, 2)], TARGETS)
    best = best_static(runs, TARGETS)
    assert best is not None and best.label == "static 3P2D"
    assert not runs[0].meets(TARGETS) and not runs[1].meets(TARGETS)
    bounds = Bounds(1, 24, 1, 8)
    plan, decisions = planner_run(profile, requests, "store-aware", TARGETS, bounds)
    raw, _ = planner_run(profile, requests, "store-aware", TARGETS, bounds, raw_prompt=True)
    # The target: both p90 targets met with at most 10% more instances (measured:
    # 1.05x at TTFT p90 3.3 s; 1.21x at 4.2 s while the warm start read the pilot's KV
    # demand after it had drained, and so started one decode instance).
    assert plan.instances <= 1.10 * best.instances
    assert plan.summary.ttft_p90 <= TARGETS.ttft_p90_s
    assert plan.summary.itl_p90 <= TARGETS.itl_p90_s
    # Sizing prefill on raw prompt tokens instead of uncached ones costs instances.
    assert raw.instances >= 1.2 * plan.instances
    assert all(bounds.prefill_min <= d.replicas.prefill <= bounds.prefill_max
               for d in decisions)
