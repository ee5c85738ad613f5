"""One simulated run: a workload through a cluster, summarised."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from disagg_operator.planner import Targets

from disagg_sim.cluster import Cluster, Outcome
from disagg_sim.profile import Profile
from disagg_sim.trace import Request


@dataclass(frozen=True)
class Summary:
    policy: str
    prefills: int
    decodes: int
    requests: int
    finished: int
    computed_share: float  # prompt tokens computed / prompt tokens sent
    ttft_p50: float
    ttft_p90: float
    itl_p50: float
    itl_p90: float
    e2e_p50: float
    skipped_prefill: int
    instance_hours: float
    slo_attainment: float | None  # share of one-minute windows whose p90s meet both targets
    requests_within: float | None  # share of requests within both targets
    store_evictions: int
    makespan: float

    def row(self) -> str:
        slo = "" if self.slo_attainment is None else f"{self.slo_attainment:>7.1%}"
        return (f"{self.policy:<13}{self.prefills:>3}P{self.decodes:<3}"
                f"{self.computed_share:>9.3f}{fmt(self.ttft_p50):>10}{fmt(self.ttft_p90):>10}"
                f"{fmt(self.itl_p50):>9}{fmt(self.itl_p90):>9}{self.skipped_prefill:>7}"
                f"{self.instance_hours:>8.2f}{slo:>8}")


HEADER = (f"{'policy':<13}{'XpYd':<7}{'computed':>9}{'TTFT p50':>10}{'p90':>10}"
          f"{'ITL p50':>9}{'p90':>9}{'skips':>7}{'inst-h':>8}{'SLO':>8}")


def fmt(seconds: float) -> str:
    return f"{seconds * 1000:.0f}ms" if seconds < 10 else f"{seconds:.1f}s"


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (the replay benchmark's definition)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))] if ordered else 0.0


def simulate(profile: Profile, requests: Sequence[Request], policy: str, prefills: int,
             decodes: int, targets: Targets | None = None, block_tokens: int | None = None
             ) -> tuple[Summary, Cluster]:
    block = block_tokens or (requests[0].block_tokens if requests else 512)
    cluster = Cluster(profile, policy, block)
    cluster.add("prefill", prefills)
    cluster.add("decode", decodes)
    for request in requests:
        cluster.submit(request)
    cluster.loop.run()
    cluster.finish_accounting()
    return summarise(cluster, prefills, decodes, targets), cluster


def summarise(cluster: Cluster, prefills: int, decodes: int, targets: Targets | None
              ) -> Summary:
    done = [o for o in cluster.outcomes if o.finish is not None]
    ttft = [o.ttft for o in done]
    itl = [o.itl for o in done if o.request.output_tokens > 1]
    prompt = sum(o.request.prompt_tokens for o in cluster.outcomes) or 1
    slo = within = None
    if targets is not None and done:
        within = sum(meets_targets(o, targets) for o in done) / len(cluster.outcomes)
        slo = window_attainment(cluster.outcomes, targets)
    return Summary(
        cluster.policy, prefills, decodes, len(cluster.outcomes), len(done),
        sum(o.computed_tokens for o in cluster.outcomes) / prompt,
        percentile(ttft, 0.5), percentile(ttft, 0.9), percentile(itl, 0.5),
        percentile(itl, 0.9),
        statistics.median([o.finish - o.request.arrival for o in done if o.finish]) if done
        else 0.0,
        sum(o.route == "skip_prefill" for o in cluster.outcomes),
        sum(cluster.instance_seconds.values()) / 3600, slo, within, cluster.store.evicted,
        cluster.loop.now)


def meets_targets(outcome: Outcome, targets: Targets) -> bool:
    """The request finished, its TTFT and (with more than one output token) its ITL within."""
    return (outcome.finish is not None and outcome.ttft <= targets.ttft_p90_s
            and (outcome.request.output_tokens <= 1 or outcome.itl <= targets.itl_p90_s))


def phase_means(outcomes: Sequence[Outcome], lookup_s: float = 0.0) -> dict[str, float]:
    """Mean seconds of each of the proxy's phases, as the proxy's histograms count them: the
    store lookup (`lookup_s` per request that had one), prefill (sent to it until it answered)
    and decode (sent to it until its first token)."""
    prefill = [o.prefilled - o.sent for o in outcomes
               if o.prefilled is not None and o.sent is not None]
    decode = [o.first_token - (o.prefilled if o.prefilled is not None else o.sent)
              for o in outcomes if o.first_token is not None and o.sent is not None]
    means = {"lookup": lookup_s} if lookup_s else {}
    if prefill:
        means["prefill"] = statistics.fmean(prefill)
    if decode:
        means["decode"] = statistics.fmean(decode)
    return means


def window_attainment(outcomes: Sequence[Outcome], targets: Targets, window_s: float = 60.0
                      ) -> float:
    """The share of one-minute windows (by arrival) whose TTFT and ITL p90 meet the targets;
    a request that never finished fails its window."""
    windows: dict[int, list[Outcome]] = {}
    for outcome in outcomes:
        windows.setdefault(int(outcome.request.arrival // window_s), []).append(outcome)
    met = 0
    for members in windows.values():
        if any(o.finish is None for o in members):
            continue
        ttft = percentile([o.ttft for o in members], 0.9)
        itl = [o.itl for o in members if o.request.output_tokens > 1]
        met += ttft <= targets.ttft_p90_s and (not itl or percentile(itl, 0.9)
                                               <= targets.itl_p90_s)
    return met / len(windows) if windows else 1.0
