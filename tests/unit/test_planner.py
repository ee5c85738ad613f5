"""The planner's decisions as pure functions."""

from __future__ import annotations

import dataclasses

import pytest
from disagg_operator.performance import DecodeModel, PrefillModel
from disagg_operator.planner import (
    FAST_DROP_DECISIONS,
    FAST_DROP_SHARE,
    MIN_UTILISATION,
    QUEUE_WAIT_FLOOR_SHARE,
    Bounds,
    Load,
    Planner,
    Replicas,
    Targets,
    prefill_need,
    recommend,
)
from hypothesis import given, settings
from hypothesis import strategies as st

PREFILL = PrefillModel(base_s=0.038, per_token_s=4.8e-5, per_token_context_s=1e-9)
DECODE = DecodeModel(base_s=0.018, per_sequence_s=1.25e-4, per_context_token_s=1.2e-8,
                     kv_capacity_tokens=500_000)
TARGETS = Targets(ttft_p90_s=2.0, itl_p90_s=0.05)

loads = st.builds(
    Load,
    requests_per_s=st.floats(0.01, 50),
    uncached_tokens_per_s=st.floats(0, 400_000),
    cached_tokens_mean=st.floats(0, 20_000),
    prompt_tokens_mean=st.floats(100, 30_000),
    output_tokens_mean=st.floats(1, 2_000),
)
bounds = st.builds(
    lambda pmin, pspan, dmin, dspan, band: Bounds(
        pmin, pmin + pspan, dmin, dmin + dspan,
        *((band[0], band[0] + band[1]) if band else (None, None))),
    st.integers(0, 4), st.integers(0, 20), st.integers(0, 4), st.integers(0, 20),
    st.none() | st.tuples(st.floats(0.25, 2), st.floats(0, 2)))


@settings(max_examples=300, deadline=None)
@given(loads, st.floats(1.01, 4))
def test_more_load_never_needs_fewer_instances(load: Load, factor: float) -> None:
    heavier = dataclasses.replace(load, requests_per_s=load.requests_per_s * factor,
                                  uncached_tokens_per_s=load.uncached_tokens_per_s * factor)
    base = recommend(load, PREFILL, DECODE, TARGETS, Bounds(0, 1000, 0, 1000))
    more = recommend(heavier, PREFILL, DECODE, TARGETS, Bounds(0, 1000, 0, 1000))
    assert more.prefill_need >= base.prefill_need * (1 - 1e-9)
    assert more.decode_need >= base.decode_need * (1 - 1e-9)
    assert more.replicas.prefill >= base.replicas.prefill
    assert more.replicas.decode >= base.replicas.decode


@settings(max_examples=300, deadline=None)
@given(loads, bounds)
def test_replicas_stay_within_their_bounds_and_the_ratio_band(load: Load, limit: Bounds) -> None:
    replicas = recommend(load, PREFILL, DECODE, TARGETS, limit).replicas
    assert limit.prefill_min <= replicas.prefill <= limit.prefill_max
    assert limit.decode_min <= replicas.decode <= limit.decode_max
    # The band holds unless a bound forbids it (the bounds win).
    if limit.ratio_min is not None and replicas.prefill < limit.ratio_min * replicas.decode - 1e-9:
        assert replicas.prefill == limit.prefill_max
    if limit.ratio_max is not None and replicas.prefill > limit.ratio_max * replicas.decode + 1e-9:
        assert replicas.decode == limit.decode_max


@settings(max_examples=100, deadline=None)
@given(loads, st.integers(1, 12), st.integers(1, 12))
def test_a_constant_load_settles_and_never_flaps(load: Load, prefill: int, decode: int) -> None:
    planner = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64), scale_down_window_s=300)
    current = Replicas(prefill, decode)
    seen = []
    for minute in range(30):
        current = planner.decide(60.0 * minute, load, current).replicas
        seen.append(current)
    settled = seen[-1]
    assert seen[-10:] == [settled] * 10
    # Once it moves towards the target it never turns back.
    for role in ("prefill", "decode"):
        counts = [getattr(r, role) for r in seen]
        steps = [b - a for a, b in zip(counts, counts[1:], strict=False) if b != a]
        assert all(s > 0 for s in steps) or all(s < 0 for s in steps)


def test_uncached_tokens_size_prefill_and_measured_latency_corrects_it() -> None:
    load = Load(requests_per_s=3.4, uncached_tokens_per_s=26_000, cached_tokens_mean=4_000,
                prompt_tokens_mean=12_000, output_tokens_mean=350)
    raw = dataclasses.replace(load, uncached_tokens_per_s=41_000, cached_tokens_mean=0)
    cached = recommend(load, PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64))
    uncached = recommend(raw, PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64))
    assert cached.replicas.prefill < uncached.replicas.prefill
    assert "uncached tokens/s" in cached.reason
    slow = recommend(dataclasses.replace(load, ttft_p90_s=3.0), PREFILL, DECODE, TARGETS,
                     Bounds(1, 64, 1, 64))
    assert slow.prefill_need == cached.prefill_need * 1.5
    assert slow.decode_need == cached.decode_need


BUSY = Load(requests_per_s=3.4, uncached_tokens_per_s=60_000, cached_tokens_mean=0,
            prompt_tokens_mean=12_000, output_tokens_mean=350)


def test_scale_down_waits_for_the_window_and_steps_one_at_a_time() -> None:
    planner = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64), scale_down_window_s=300)
    # A swing down within the load: a quarter less (more than FAST_DROP_SHARE of the count).
    lull = dataclasses.replace(BUSY, requests_per_s=2.55, uncached_tokens_per_s=45_000)
    high = planner.decide(0, BUSY, Replicas(1, 1)).replicas
    assert high.prefill > 2  # up at once
    lower = recommend(lull, PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64)).replicas.prefill
    assert FAST_DROP_SHARE * high.prefill < lower < high.prefill
    counts = [planner.decide(60.0 * m, lull, high).replicas.prefill for m in range(1, 5)]
    assert counts == [high.prefill] * 4  # the busy minute is still in the window
    after = planner.decide(360, lull, high).replicas.prefill
    assert after == high.prefill - 1


def test_a_load_that_fell_far_scales_down_before_the_window_ends() -> None:
    """When the last few recommendations all ask for far fewer instances than run, the load
    changed (a rate step down): the window's older recommendations no longer hold the count,
    which still falls one instance a decision. One low recommendation is not enough."""
    planner = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64), scale_down_window_s=600)
    quiet = dataclasses.replace(BUSY, requests_per_s=0.5, uncached_tokens_per_s=5_000)
    high = planner.decide(0, BUSY, Replicas(1, 1)).replicas
    assert planner.decide(60, quiet, high).replicas == high  # one quiet interval: a swing
    assert planner.decide(120, BUSY, high).replicas == high
    counts = [high.prefill]
    for m in range(3, 3 + FAST_DROP_DECISIONS + 2):
        counts.append(planner.decide(60.0 * m, quiet, Replicas(counts[-1], 1)).replicas.prefill)
    held = FAST_DROP_DECISIONS - 1  # the busy interval is among the last few until then
    assert counts[1:held + 1] == [high.prefill] * held
    assert counts[held + 1:] == [high.prefill - 1, high.prefill - 2, high.prefill - 3][
        :len(counts) - held - 1]


def test_a_worked_off_backlog_or_latency_spike_does_not_hold_instances_for_the_window() -> None:
    """Instances added to work off a backlog (or for measured latencies over target) are
    transient: once the queue is gone, the count goes back to what the arrivals need, without
    waiting for the scale-down window that protects against swings in the arrivals."""
    planner = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64), scale_down_window_s=300,
                      scale_down_step=64)
    steady = Load(requests_per_s=3.4, uncached_tokens_per_s=60_000, cached_tokens_mean=0,
                  prompt_tokens_mean=12_000, output_tokens_mean=350)
    queued = dataclasses.replace(steady, queued_uncached_tokens=5_000_000, ttft_p90_s=30.0)
    base = planner.decide(0, steady, Replicas(1, 1)).replicas
    spike = planner.decide(60, queued, base).replicas
    assert spike.prefill > base.prefill
    assert spike.prefill == recommend(queued, PREFILL, DECODE, TARGETS,
                                      Bounds(1, 64, 1, 64)).replicas.prefill
    assert planner.decide(120, steady, spike).replicas.prefill == base.prefill
    # Transient parts can be kept in the window, as before.
    holding = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64), scale_down_window_s=300,
                      scale_down_step=64, transient_scale_down=False)
    holding.decide(0, steady, Replicas(1, 1))
    holding.decide(60, queued, base)
    assert holding.decide(120, steady, spike).replicas.prefill == spike.prefill


def test_a_burst_of_sequences_into_decode_does_not_hold_decode_for_the_window() -> None:
    """When prefill works off a backlog, decode receives a burst of sequences and its KV
    demand jumps past what the arrivals' own sequences hold: decode scales up for it, and
    back down once it is gone, like prefill's backlog."""
    planner = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64), scale_down_window_s=300,
                      scale_down_step=64)
    steady = Load(requests_per_s=3.4, uncached_tokens_per_s=60_000, cached_tokens_mean=0,
                  prompt_tokens_mean=12_000, output_tokens_mean=350, kv_tokens_demand=300_000)
    burst = dataclasses.replace(steady, kv_tokens_demand=3_000_000)
    base = planner.decide(0, steady, Replicas(1, 1)).replicas
    spike = planner.decide(60, burst, base).replicas
    assert spike.decode > base.decode
    arrivals_own = recommend(burst, PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64)).steady
    assert arrivals_own is not None and arrivals_own.decode < spike.decode
    assert planner.decide(120, steady, spike).replicas.decode == arrivals_own.decode


def test_a_backlog_is_not_counted_twice_through_the_latency_it_causes() -> None:
    """A queue of prompt tokens makes the measured TTFT high: the backlog term already adds
    the instances that work it off, so the latency correction does not multiply them again;
    without a backlog a high TTFT still scales prefill up."""
    bounds = Bounds(1, 64, 1, 64)
    load = Load(requests_per_s=3.4, uncached_tokens_per_s=60_000, cached_tokens_mean=0,
                prompt_tokens_mean=12_000, output_tokens_mean=350)
    queued = dataclasses.replace(load, queued_uncached_tokens=5_000_000)
    slow = dataclasses.replace(queued, ttft_p90_s=30.0)
    assert recommend(slow, PREFILL, DECODE, TARGETS, bounds).prefill_need == \
        recommend(queued, PREFILL, DECODE, TARGETS, bounds).prefill_need
    unexplained = dataclasses.replace(load, ttft_p90_s=30.0)
    assert recommend(unexplained, PREFILL, DECODE, TARGETS, bounds).prefill_need == \
        1.5 * recommend(load, PREFILL, DECODE, TARGETS, bounds).prefill_need


def test_a_queue_that_breaks_the_ttft_target_scales_up_between_decisions() -> None:
    """The queue's wait is read at the throughput of the last decision's prompts; past what
    the TTFT target leaves after the p90 prompt's own prefill it calls for a scale-up now,
    which adds instances and never removes any, and which the scale-down window does not
    remember."""
    bounds = Bounds(1, 64, 1, 64)
    planner = Planner(PREFILL, DECODE, TARGETS, bounds, scale_down_window_s=600)
    assert planner.queue_wait_s(1e9, 1) is None  # no decision yet: no throughput known
    assert not planner.queue_breaks_ttft(1e9, 1)
    quiet = dataclasses.replace(BUSY, requests_per_s=0.5, uncached_tokens_per_s=5_000,
                                uncached_tokens_p90=16_000)
    low = planner.decide(0, quiet, Replicas(1, 1)).replicas
    per_instance = PREFILL.tokens_per_second(0, 10_000)  # the quiet prompts' mean length
    budget = TARGETS.ttft_p90_s - PREFILL.prompt_seconds(16_000)
    at_target = budget * per_instance * low.prefill
    assert planner.queue_wait_s(at_target, low.prefill) == pytest.approx(budget)
    assert not planner.queue_breaks_ttft(at_target * 0.99, low.prefill)
    assert planner.queue_breaks_ttft(at_target * 1.01, low.prefill)
    # More instances work the same queue off sooner.
    assert not planner.queue_breaks_ttft(at_target * 1.01, low.prefill + 1)

    surge = dataclasses.replace(BUSY, queued_uncached_tokens=at_target * 2)
    up = planner.scale_up(surge, low)
    assert up.replicas.prefill > low.prefill
    assert up.replicas.prefill == recommend(surge, PREFILL, DECODE, TARGETS,
                                            bounds).replicas.prefill
    assert "queue breaks the TTFT target" in up.reason
    assert planner.scale_up(quiet, Replicas(9, 9)).replicas == Replicas(9, 9)  # never down
    # Not recorded: the next decision on a quiet interval may go back down at once.
    assert planner.decide(60, quiet, up.replicas).replicas.prefill == up.replicas.prefill - 1


@settings(max_examples=200, deadline=None)
@given(loads, st.floats(0, 60_000), st.floats(1.01, 3))
def test_a_longer_p90_prompt_never_needs_fewer_or_unboundedly_many_prefill_instances(
        load: Load, p90: float, factor: float) -> None:
    """More instances cannot make one long prompt faster: as the p90 prompt's own prefill
    time nears the TTFT target, prefill is sized no busier than the floor the planner uses for
    a prompt past the target, never for an idle queue (needs in the thousands)."""
    shorter = dataclasses.replace(load, uncached_tokens_p90=p90)
    longer = dataclasses.replace(load, uncached_tokens_p90=p90 * factor)
    short_need, _ = prefill_need(shorter, PREFILL, TARGETS.ttft_p90_s)
    long_need, _ = prefill_need(longer, PREFILL, TARGETS.ttft_p90_s)
    assert long_need >= short_need * (1 - 1e-9)
    capacity = PREFILL.tokens_per_second(load.cached_tokens_mean, load.uncached_tokens_per_s
                                         / load.requests_per_s)
    assert long_need <= load.uncached_tokens_per_s / (capacity * MIN_UTILISATION) * (1 + 1e-9)


def test_a_queue_may_wait_at_least_a_share_of_the_target_when_the_p90_prompt_fills_it() -> None:
    planner = Planner(PREFILL, DECODE, TARGETS, Bounds(1, 64, 1, 64))
    long = dataclasses.replace(BUSY, uncached_tokens_p90=60_000)  # alone past the target
    assert PREFILL.prompt_seconds(60_000) > TARGETS.ttft_p90_s
    planner.decide(0, long, Replicas(4, 4))
    per_instance = PREFILL.tokens_per_second(0, BUSY.uncached_tokens_per_s
                                             / BUSY.requests_per_s)
    floor = QUEUE_WAIT_FLOOR_SHARE * TARGETS.ttft_p90_s * per_instance * 4
    assert not planner.queue_breaks_ttft(floor * 0.99, 4)
    assert planner.queue_breaks_ttft(floor * 1.01, 4)
