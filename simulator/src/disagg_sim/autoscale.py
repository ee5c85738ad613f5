"""The planner (disagg_operator.planner, the code the operator runs) driven by simulated time:
every interval it sees what the cluster saw, and its decision adds instances (serving after
the profile's start-up delay) or drains them. Between decisions it samples decode's KV and
prefill's queue every SAMPLE_S, as the operator does; a queue that breaks the TTFT target
scales up at once."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagg_operator.planner import (
    SHORTEST_LOAD_WINDOW_S,
    Load,
    Planner,
    Recommendation,
    Replicas,
    Targets,
)

from disagg_sim.cluster import Cluster
from disagg_sim.simulate import Summary, percentile, summarise
from disagg_sim.trace import Request

SAMPLE_S = 5.0
KV_QUANTILE = 0.9  # of the interval's KV demand samples (the operator's too)
LATENCY_WINDOW_S = 300.0


@dataclass(frozen=True)
class Decision:
    at: float
    replicas: Replicas
    recommendation: Recommendation


def observe(cluster: Cluster, since: float, now: float, raw_prompt: bool,
            kv_demand: float | None = None, latency_window_s: float = LATENCY_WINDOW_S
            ) -> Load:
    """The interval's load as the proxy's and engines' metrics give it. `raw_prompt` sizes
    on every prompt token, as a planner that ignores caches would; `kv_demand` is the
    interval's mean (default: now)."""
    if kv_demand is None:
        kv_demand = kv_demand_now(cluster)
    window = max(now - since, 1e-9)
    arrived = [o for o in cluster.outcomes if since <= o.request.arrival < now]
    prefilled = [o for o in arrived if o.route == "prefill"]
    if raw_prompt:
        lengths = [o.request.prompt_tokens for o in arrived]
        cached_mean = 0.0
    else:
        lengths = [o.computed_tokens for o in prefilled]
        cached_mean = statistics.fmean(o.request.prompt_tokens - o.computed_tokens
                                       for o in prefilled) if prefilled else 0.0
    uncached = sum(lengths)
    mean = statistics.fmean(lengths) if lengths else 0.0
    cv2 = statistics.pvariance(lengths) / mean ** 2 if len(lengths) > 1 and mean else 1.0
    # Latencies over a longer window: one minute's p90 swings with a few long prompts, and
    # the planner's correction should follow the trend, not that noise.
    recent = now - max(latency_window_s, now - since)
    first = [o.ttft for o in cluster.outcomes
             if o.first_token is not None and recent <= o.first_token < now]
    done = [o.itl for o in cluster.outcomes if o.finish is not None and recent <= o.finish < now
            and o.request.output_tokens > 1]
    return Load(
        requests_per_s=len(arrived) / window, uncached_tokens_per_s=uncached / window,
        cached_tokens_mean=cached_mean,
        prompt_tokens_mean=statistics.fmean(o.request.prompt_tokens for o in arrived)
        if arrived else 0.0,
        output_tokens_mean=statistics.fmean(o.request.output_tokens for o in arrived)
        if arrived else 0.0,
        ttft_p90_s=percentile(first, 0.9) if first else None,
        itl_p90_s=percentile(done, 0.9) if done else None,
        kv_tokens_demand=kv_demand,
        uncached_tokens_p90=percentile(lengths, 0.9) if lengths else None,
        uncached_tokens_cv2=cv2,
        queued_uncached_tokens=0.0 if raw_prompt else queued_uncached_tokens(cluster))


def kv_demand_now(cluster: Cluster) -> float:
    """KV tokens decode instances hold or queue for (vLLM: KV usage x capacity + queue)."""
    return sum(d.reserved_tokens + sum(s.reserved_tokens for s in d.waiting)
               for d in cluster.decodes)


def queued_uncached_tokens(cluster: Cluster) -> float:
    """Prompt tokens routed to prefill instances and not computed yet."""
    return float(sum(p.expected_tokens for p in cluster.prefills))


def sample_kv_demand(cluster: Cluster, more: Callable[[], bool],
                     also: Callable[[], None] | None = None) -> list[float]:
    """KV demand every SAMPLE_S from now while `more()` says so after a sample, as a metrics
    scrape would see it: the list fills while the cluster's loop runs. `also` runs after each
    sample."""
    samples: list[float] = []

    def sample() -> None:
        samples.append(kv_demand_now(cluster))
        if also is not None:
            also()
        if more():
            cluster.loop.at(cluster.loop.now + SAMPLE_S, sample)

    cluster.loop.at(cluster.loop.now + SAMPLE_S, sample)
    return samples


def simulate_autoscaled(cluster: Cluster, requests: Sequence[Request], planner: Planner,
                        initial: Replicas, interval_s: float, targets: Targets | None = None,
                        raw_prompt: bool = False) -> tuple[Summary, list[Decision]]:
    cluster.add("prefill", initial.prefill)
    cluster.add("decode", initial.decode)
    for request in requests:
        cluster.submit(request)
    last_arrival = max((r.arrival for r in requests), default=0.0)
    decisions: list[Decision] = []
    startup = cluster.profile.startup_s
    last_tick = 0.0

    def current() -> Replicas:
        return Replicas(cluster.provisioned("prefill"), cluster.provisioned("decode"))

    def apply(now: float, decided: Recommendation) -> None:
        cluster.resize("prefill", decided.replicas.prefill, delay=startup)
        cluster.resize("decode", decided.replicas.decode, delay=startup)
        decisions.append(Decision(now, decided.replicas, decided))

    def urgent() -> None:
        """Between decisions: a queue that breaks the TTFT target scales up now, on the load
        since the last decision (the operator's sampler does the same)."""
        now, have = cluster.loop.now, current()
        if now - last_tick < SHORTEST_LOAD_WINDOW_S or not planner.queue_breaks_ttft(
                queued_uncached_tokens(cluster), have.prefill):
            return
        load = observe(cluster, last_tick, now, raw_prompt, max(samples[-3:]))
        if load.requests_per_s > 0:
            decided = planner.scale_up(load, have)
            if decided.replicas != have:
                apply(now, decided)

    samples = sample_kv_demand(cluster, lambda: cluster.loop.now < last_arrival or any(
        o.finish is None for o in cluster.outcomes), urgent)

    def tick() -> None:
        nonlocal last_tick
        now = cluster.loop.now
        load = observe(cluster, now - interval_s, now, raw_prompt,
                       percentile(samples, KV_QUANTILE) if samples else None)
        samples.clear()
        last_tick = now
        if load.requests_per_s > 0:
            have = current()
            apply(now, planner.decide(now, load, have))
        unfinished = any(o.finish is None for o in cluster.outcomes)
        if now < last_arrival or unfinished:
            cluster.loop.at(now + interval_s, tick)

    cluster.loop.at(interval_s, tick)
    cluster.loop.run()
    cluster.finish_accounting()
    return summarise(cluster, initial.prefill, initial.decode, targets), decisions
