"""Static configurations against the planner, on one workload: the sweep, a warm-started
planner run, and the comparison the autoscaling benchmark prints."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from disagg_operator.planner import Bounds, Planner, Replicas, Targets, recommend

from disagg_sim.autoscale import (
    KV_QUANTILE,
    SAMPLE_S,
    Decision,
    observe,
    sample_kv_demand,
    simulate_autoscaled,
)
from disagg_sim.cluster import Cluster, Outcome
from disagg_sim.profile import Profile
from disagg_sim.simulate import Summary, meets_targets, percentile, simulate, summarise
from disagg_sim.trace import Request


@dataclass(frozen=True)
class Run:
    label: str
    summary: Summary
    instances: float  # mean instances over the run: instance-hours / hours

    def meets(self, targets: Targets) -> bool:
        return (self.summary.ttft_p90 <= targets.ttft_p90_s
                and self.summary.itl_p90 <= targets.itl_p90_s
                and self.summary.finished == self.summary.requests)


def hours(requests: Sequence[Request]) -> float:
    return max((r.arrival for r in requests), default=0.0) / 3600


def static_run(profile: Profile, requests: Sequence[Request], policy: str, prefill: int,
               decode: int, targets: Targets) -> Run:
    summary, _ = simulate(profile, requests, policy, prefill, decode, targets)
    return Run(f"static {prefill}P{decode}D", summary, float(prefill + decode))


def sweep(profile: Profile, requests: Sequence[Request], policy: str,
          configs: Iterable[tuple[int, int]], targets: Targets) -> list[Run]:
    return [static_run(profile, requests, policy, p, d, targets) for p, d in configs]


def best_static(runs: Sequence[Run], targets: Targets) -> Run | None:
    """The fewest instances that meet both targets (ties: the higher SLO attainment)."""
    meeting = [r for r in runs if r.meets(targets)]
    return min(meeting, key=lambda r: (r.instances, -(r.summary.slo_attainment or 0)),
               default=None)


def planner_for(profile: Profile, targets: Targets, bounds: Bounds,
                scale_down_window_s: float) -> Planner:
    return Planner(profile.prefill, profile.decode,
                   targets, bounds,
                   scale_down_window_s=scale_down_window_s)


def warm_start(profile: Profile, requests: Sequence[Request], policy: str, targets: Targets,
               bounds: Bounds, interval_s: float, raw_prompt: bool) -> Replicas:
    """What the planner would have running already: its recommendation for the first
    interval's load, observed in a short pilot run with room to spare (its KV demand sampled
    while it runs, as the planner's driver samples it: read after the pilot, it is zero)."""
    pilot = [r for r in requests if r.arrival < interval_s]
    cluster = Cluster(profile, policy, pilot[0].block_tokens if pilot else 512)
    cluster.add("prefill", bounds.prefill_max)
    cluster.add("decode", bounds.decode_max)
    for request in pilot:
        cluster.submit(request)
    samples = sample_kv_demand(cluster,
                               lambda: cluster.loop.now + SAMPLE_S <= interval_s)
    cluster.loop.run()
    load = observe(cluster, 0.0, interval_s, raw_prompt,
                   percentile(samples, KV_QUANTILE) if samples else None)
    return recommend(load, profile.prefill, profile.decode,
                     targets, bounds).replicas


def planner_run(profile: Profile, requests: Sequence[Request], policy: str, targets: Targets,
                bounds: Bounds, interval_s: float = 180.0, scale_down_window_s: float = 360.0,
                raw_prompt: bool = False) -> tuple[Run, list[Decision]]:
    initial = warm_start(profile, requests, policy, targets, bounds, interval_s, raw_prompt)
    planner = planner_for(profile, targets, bounds, scale_down_window_s)
    cluster = Cluster(profile, policy, requests[0].block_tokens if requests else 512)
    summary, decisions = simulate_autoscaled(cluster, requests, planner, initial, interval_s,
                                             targets, raw_prompt)
    span = summary.makespan / 3600 or 1.0
    label = "planner (raw prompt tokens)" if raw_prompt else "planner"
    return Run(label, summary, summary.instance_hours / span), decisions


Schedule = Sequence[tuple[float, Replicas]]  # from each second on, these replicas


def scheduled_run(profile: Profile, requests: Sequence[Request], policy: str,
                  schedule: Schedule, targets: Targets) -> tuple[Summary, Cluster]:
    """A run whose instance counts change at fixed times (instances serve at once; those
    taken away drain), as a planner that knew the load in advance would set them."""
    cluster = Cluster(profile, policy, requests[0].block_tokens if requests else 512)
    first = schedule[0][1]
    cluster.add("prefill", first.prefill)
    cluster.add("decode", first.decode)
    for request in requests:
        cluster.submit(request)

    def resize(replicas: Replicas) -> None:
        cluster.resize("prefill", replicas.prefill)
        cluster.resize("decode", replicas.decode)

    for at, replicas in schedule[1:]:
        cluster.loop.at(at, functools.partial(resize, replicas))
    cluster.loop.run()
    cluster.finish_accounting()
    return summarise(cluster, first.prefill, first.decode, targets), cluster


def within_between(outcomes: Sequence[Outcome], targets: Targets, start: float, end: float
                   ) -> float:
    """The share of the requests arriving in [start, end) that met both targets."""
    members = [o for o in outcomes if start <= o.request.arrival < end]
    return sum(meets_targets(o, targets) for o in members) / len(members) if members else 1.0


def known_steps(profile: Profile, requests: Sequence[Request], policy: str, targets: Targets,
                starts: Sequence[float], largest: Replicas, goal: float
                ) -> list[tuple[float, Replicas]]:
    """For each phase (from each of `starts` to the next), the fewest instances that serve
    `goal` of the phase's requests within both targets, the phases before it at their own
    picks (and the requests after it left out): what a planner that knew every step in
    advance, and whose instances served at once, would run. `starts[0]` is 0. Per decode
    count, prefill is found by bisection (more prefill instances never serve fewer within the
    targets)."""
    picks: list[tuple[float, Replicas]] = []
    ends = [*starts[1:], float("inf")]
    for start, end in zip(starts, ends, strict=True):
        phase = [r for r in requests if r.arrival < end]

        def enough(replicas: Replicas, start: float = start, end: float = end,
                   phase: Sequence[Request] = phase) -> bool:
            schedule = [*picks, (start, replicas)] if picks else [(start, replicas)]
            _, cluster = scheduled_run(profile, phase, policy, schedule, targets)
            return within_between(cluster.outcomes, targets, start, end) >= goal

        best = largest
        for decode in range(1, largest.decode + 1):
            if not enough(Replicas(largest.prefill, decode)):
                continue
            low, high = 0, largest.prefill  # `high` is enough, `low` is not
            while high - low > 1:
                middle = (low + high) // 2
                low, high = (low, middle) if enough(Replicas(middle, decode)) else (middle, high)
            if high + decode < best.prefill + best.decode:
                best = Replicas(high, decode)
        picks.append((start, best))
    return picks
