"""The planner in the simulator on the whole recorded trace and its rate-step transform: a small
in-CI version of benchmarks/sim_autoscaling.py that asserts its figures (a few static
configurations around the best instead of the whole sweep)."""

from __future__ import annotations

import dataclasses

from disagg_operator.planner import SHORTEST_LOAD_WINDOW_S, Bounds, Replicas, Targets
from disagg_sim.evaluation import (
    best_static,
    known_steps,
    planner_run,
    scheduled_run,
    sweep,
    within_between,
)
from disagg_sim.profile import load_profile
from disagg_sim.trace import (
    CONVERSATION_TRACE,
    apply_rate_steps,
    parse_rate_steps,
    read_trace,
    scaled_arrivals,
    to_requests,
)

TRACE = CONVERSATION_TRACE
TARGETS = Targets(ttft_p90_s=4.0, itl_p90_s=0.05)


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
    # The issue's target: both p90 targets met with at most 10% more instances (measured:
    # 1.05x at TTFT p90 3.3 s; 1.21x at 4.2 s while the warm start read the pilot's KV
    # demand after it had drained, and so started one decode instance).
    assert plan.instances <= 1.10 * best.instances
    assert plan.summary.ttft_p90 <= TARGETS.ttft_p90_s
    assert plan.summary.itl_p90 <= TARGETS.itl_p90_s
    # Sizing prefill on raw prompt tokens instead of uncached ones costs instances.
    assert raw.instances >= 1.2 * plan.instances
    assert all(bounds.prefill_min <= d.replicas.prefill <= bounds.prefill_max
               for d in decisions)


def test_a_rate_step_up_is_answered_between_decisions() -> None:
    """With decisions every 180 s, the queue a 3x step builds is seen by the 5 s samples and
    scales prefill up within seconds, not at the next decision."""
    profile = dataclasses.replace(load_profile("deepseek-v3-h200"), startup_s=0)
    rows = apply_rate_steps(read_trace(TRACE), parse_rate_steps("0:1,1200:3"))
    requests = [r for r in to_requests(rows, arrivals=scaled_arrivals(rows))
                if r.arrival < 1500]
    _, decisions = planner_run(profile, requests, "store-aware", TARGETS, Bounds(1, 24, 1, 8),
                               interval_s=180)
    before = [d for d in decisions if d.at <= 1200][-1].replicas.prefill
    first_up = next(d for d in decisions if d.at > 1200 and d.replicas.prefill > before)
    assert "queue breaks the TTFT target" in first_up.recommendation.reason
    assert first_up.at <= 1200 + SHORTEST_LOAD_WINDOW_S  # the next decision is at 1260


def test_a_schedule_that_knows_the_steps_picks_each_phases_fewest_instances() -> None:
    """The known-steps reference of the autoscaling benchmark: per phase the fewest instances
    serving the goal share of its requests within both targets; one fewer prefill instance
    in any phase misses it there."""
    profile = load_profile("deepseek-v3-h200")
    rows = apply_rate_steps(read_trace(TRACE), parse_rate_steps("0:1,300:3"))
    requests = [r for r in to_requests(rows, arrivals=scaled_arrivals(rows)) if r.arrival < 600]
    picks = known_steps(profile, requests, "store-aware", TARGETS, [0, 300], Replicas(16, 4),
                        0.9)
    assert [at for at, _ in picks] == [0, 300]
    low, high = picks[0][1], picks[1][1]
    assert high.prefill + high.decode > low.prefill + low.decode  # 3x needs more
    _, cluster = scheduled_run(profile, requests, "store-aware", picks, TARGETS)
    for start, end in ((0, 300), (300, 600)):
        assert within_between(cluster.outcomes, TARGETS, start, end) >= 0.9
    for phase, (start, replicas) in enumerate(picks):
        fewer = [*picks]
        fewer[phase] = (start, Replicas(replicas.prefill - 1, replicas.decode))
        _, short = scheduled_run(profile, requests, "store-aware", fewer, TARGETS)
        end = picks[phase + 1][0] if phase + 1 < len(picks) else 600
        assert within_between(short.outcomes, TARGETS, start, end) < 0.9


def test_the_planner_on_rate_steps_meets_the_issues_target_when_instances_serve_at_once(
        ) -> None:
    """The rate-step row of the autoscaling benchmark (`--interval 30 --startup 0`): at least
    95% of requests within both targets on at most 70% of the instance-hours of the static
    configuration sized for the peak (10P4D: one instance fewer of either role serves fewer
    than 95% within; the benchmark's sweep finds it)."""
    profile = load_profile("deepseek-v3-h200")
    rows = apply_rate_steps(read_trace(TRACE), parse_rate_steps("0:1,1200:3,2400:0.5"))
    requests = to_requests(rows, arrivals=scaled_arrivals(rows))
    peak, fewer_prefill, fewer_decode = sweep(profile, requests, "store-aware",
                                              [(10, 4), (9, 4), (10, 3)], TARGETS)
    assert (peak.summary.requests_within or 0) >= 0.95
    assert (fewer_prefill.summary.requests_within or 0) < 0.95
    assert (fewer_decode.summary.requests_within or 0) < 0.95
    quick = dataclasses.replace(profile, startup_s=0)
    plan, _ = planner_run(quick, requests, "store-aware", TARGETS, Bounds(1, 24, 1, 8),
                          interval_s=30)
    # Measured: 68.0% at 95.5% (71.0% at 95.1% before prefill was sized at least half busy
    # and the queue's budget counted the p90 prompt's own prefill).
    assert plan.summary.instance_hours <= 0.70 * peak.summary.instance_hours
    assert (plan.summary.requests_within or 0) >= 0.95
