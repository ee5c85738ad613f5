"""The planner: prefill and decode replicas from observed load, profiled performance and
latency targets. Pure; the operator and the simulator each drive it with their own clock and
metrics (one implementation, two drivers).

Prefill is sized on *uncached* prompt tokens per second (what the store and the engines'
prefix caches do not already hold), decode on concurrent sequences and their context:

- prefill: each instance serves `mu` tokens/s when saturated. A queue in front of it adds, at
  utilisation rho, a mean wait of rho / (1 - rho) * (1 + cv2) / 2 mean services (M/G/1,
  cv2 the squared coefficient of variation of prompt lengths), and its 90th percentile about
  2.3 times that; the largest rho whose p90 prompt's prefill time plus that wait fits the
  TTFT target (but at least MIN_UTILISATION) sets the replicas: demand / (mu * rho), the
  demand counting a backlog of queued prompt tokens to be worked off within BACKLOG_DRAIN_S.
- decode: the largest batch whose step fits the ITL target (and the KV space) sets how many
  sequences one instance holds; Little's law gives the concurrent sequences. The KV tokens
  running and queued sequences want, over the instances' KV space kept KV_HEADROOM full,
  give a second floor: long prompts fill KV before the batch is full. What the arrivals'
  own sequences hold (Little's law) is its steady part; more is a burst prefill worked off.
- measured p90 latencies above target scale the role up (by at most 1.5x; prefill's only
  when no backlog being worked off explains its TTFT); then the counts are
  clamped to their bounds, kept in the P:D ratio band, and stabilised: a scale-down waits until
  every recommendation within the window agrees (or the last few all ask for far fewer: the
  load changed), and removes at most `scale_down_step`.
- between decisions, a prefill queue that would make a p90 prompt arriving now miss the TTFT
  target scales up at once (`Planner.scale_up`), instead of at the next interval.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from disagg_operator.performance import DecodeModel, PrefillModel

# The 90th percentile of an exponential-tailed wait, in means (ln 10).
P90_OF_MEAN = 2.3
MAX_UTILISATION = 0.95
# No busier than this when the p90 prompt's own prefill time leaves little or none of the TTFT
# target to queue in: more instances cannot make that prompt faster, and sizing for a queue
# that is idle almost always asked for instances by the hundred.
MIN_UTILISATION = 0.5
MAX_CORRECTION = 1.5
MAX_CV2 = 1.0
# A prefill backlog is sized to be worked off within this long, on top of the arrivals.
BACKLOG_DRAIN_S = 120.0
# A backlog adding more than this share to prefill's need explains a high measured TTFT:
# the latency correction is then left out, so the queue is not counted twice.
BACKLOG_EXPLAINS_TTFT = 0.1
# Decode KV space is filled to at most this share: prompt lengths vary (one long prompt can
# take a tenth of an instance), and a full instance queues the next sequence.
KV_HEADROOM = 0.7
# A scale-down waits for the whole window to agree, so that a swing within the load does not
# remove instances the next swing needs; but when the last FAST_DROP_DECISIONS steady
# recommendations all ask for at most FAST_DROP_SHARE of the current count, the load itself
# changed (a rate step down), and only those recommendations hold the count.
FAST_DROP_DECISIONS = 3
FAST_DROP_SHARE = 0.7
# Between decisions, a queue may add at least this share of the TTFT target before it calls
# for a scale-up, even where the p90 prompt's own prefill takes the whole target: shorter
# queues are ordinary batching.
QUEUE_WAIT_FLOOR_SHARE = 0.25
# A load measured over less than this is too noisy to scale on between decisions.
SHORTEST_LOAD_WINDOW_S = 20.0


@dataclass(frozen=True)
class Load:
    """What one interval saw. Token figures are per second; lengths are per request."""
    requests_per_s: float
    uncached_tokens_per_s: float  # prompt tokens prefill instances computed
    cached_tokens_mean: float  # per prefilled request, served from a cache
    prompt_tokens_mean: float
    output_tokens_mean: float
    ttft_p90_s: float | None = None
    itl_p90_s: float | None = None
    # KV tokens decode instances hold or wait to hold (running plus queued sequences' prompt
    # and output), summed over instances: vLLM's KV usage times capacity, plus the queue.
    kv_tokens_demand: float | None = None
    # The spread of uncached prompt lengths: their 90th percentile, and the squared
    # coefficient of variation (1 for exponential lengths; the trace's is above 1).
    uncached_tokens_p90: float | None = None
    uncached_tokens_cv2: float = 1.0
    # Prompt tokens routed to prefill instances and not computed yet, now (the proxy's
    # queued-work gauge): a backlog the arrival rate alone does not show.
    queued_uncached_tokens: float = 0.0


@dataclass(frozen=True)
class Targets:
    ttft_p90_s: float
    itl_p90_s: float


@dataclass(frozen=True)
class Bounds:
    prefill_min: int = 1
    prefill_max: int = 16
    decode_min: int = 1
    decode_max: int = 16
    ratio_min: float | None = None  # prefill / decode
    ratio_max: float | None = None


@dataclass(frozen=True)
class Replicas:
    prefill: int
    decode: int


@dataclass(frozen=True)
class Recommendation:
    replicas: Replicas
    prefill_need: float  # instances the load needs before rounding and bounds
    decode_need: float
    reason: str
    # What the arrivals alone need, without working off a backlog or correcting for measured
    # latencies: both are transient, so a scale-down waits only for this to agree.
    steady: Replicas | None = None


def p90_prompt_seconds(load: Load, model: PrefillModel) -> float:
    """The p90 uncached prompt's own prefill time, alone on an instance."""
    uncached_mean = load.uncached_tokens_per_s / max(load.requests_per_s, 1e-9)
    return model.prompt_seconds(max(uncached_mean, load.uncached_tokens_p90 or 0.0),
                                load.cached_tokens_mean)


def prefill_need(load: Load, model: PrefillModel, ttft_target: float,
                 backlog_drain_s: float | None = BACKLOG_DRAIN_S) -> tuple[float, str]:
    """Prefill instances for the load; `backlog_drain_s` None leaves the backlog out."""
    if load.uncached_tokens_per_s <= 0 and (load.queued_uncached_tokens <= 0
                                            or backlog_drain_s is None):
        return 0.0, "no prefill work"
    uncached_mean = load.uncached_tokens_per_s / max(load.requests_per_s, 1e-9)
    service = model.prompt_seconds(uncached_mean, load.cached_tokens_mean)
    slow = p90_prompt_seconds(load, model)
    note = ""
    if slow >= ttft_target:
        rho, note = MIN_UTILISATION, (f"; a p90 prompt alone takes {slow:.2f}s, over the TTFT "
                                      f"target {ttft_target:g}s")
    else:
        # Pollaczek-Khinchine: mean wait = rho / (1 - rho) * service * (1 + cv2) / 2.
        spread = (1 + min(load.uncached_tokens_cv2, MAX_CV2)) / 2
        headroom = (ttft_target - slow) / (P90_OF_MEAN * service * spread)
        rho = max(MIN_UTILISATION, min(MAX_UTILISATION, headroom / (1 + headroom)))
    capacity = model.tokens_per_second(load.cached_tokens_mean, uncached_mean) * rho
    backlog = 0.0 if backlog_drain_s is None else load.queued_uncached_tokens / backlog_drain_s
    need = (load.uncached_tokens_per_s + backlog) / capacity
    if backlog > 0.1 * load.uncached_tokens_per_s:
        note += f"; {load.queued_uncached_tokens:.0f} queued tokens to work off"
    return need, (f"{load.uncached_tokens_per_s:.0f} uncached tokens/s over "
                  f"{capacity:.0f} per instance at {rho:.0%} busy{note}")


def decode_need(load: Load, model: DecodeModel, itl_target: float,
                steady: bool = False) -> tuple[float, str]:
    """Decode instances for the load; `steady` counts only the KV space the arrivals' own
    sequences hold (a burst of sequences that prefill worked off a backlog is transient)."""
    if load.requests_per_s <= 0:
        return 0.0, "no decode work"
    context = load.prompt_tokens_mean + load.output_tokens_mean / 2
    reserved = load.prompt_tokens_mean + load.output_tokens_mean
    batch = model.batch_within(itl_target, context, reserved)
    step = model.step_seconds(batch, context)
    sequences = load.requests_per_s * load.output_tokens_mean * step
    by_batch = sequences / batch
    kv = load.kv_tokens_demand or 0.0
    if steady:
        kv = min(kv, sequences * reserved)
    by_kv = kv / (model.kv_capacity_tokens * KV_HEADROOM)
    if by_kv > by_batch:
        return by_kv, (f"{kv:.0f} KV tokens wanted over "
                       f"{model.kv_capacity_tokens * KV_HEADROOM:.0f} per instance")
    return by_batch, (f"{sequences:.0f} concurrent sequences over {batch} per instance "
                      f"within the ITL target")


def correction(measured: float | None, target: float) -> float:
    if measured is None or measured <= target:
        return 1.0
    return min(MAX_CORRECTION, measured / target)


def within_band(p: int, d: int, bounds: Bounds) -> tuple[int, int]:
    """Raise the short side until prefill/decode is in the band, or a maximum stops it."""
    for _ in range(bounds.prefill_max + bounds.decode_max + 1):
        if bounds.ratio_min is not None and p < bounds.ratio_min * d - 1e-9 \
                and p < bounds.prefill_max:
            p = min(bounds.prefill_max, math.ceil(bounds.ratio_min * d - 1e-9))
        elif bounds.ratio_max is not None and p > bounds.ratio_max * d + 1e-9 \
                and d < bounds.decode_max:
            d = min(bounds.decode_max, math.ceil(p / bounds.ratio_max - 1e-9))
        else:
            break
    return p, d


def bounded(p_need: float, d_need: float, bounds: Bounds) -> Replicas:
    p = min(bounds.prefill_max, max(bounds.prefill_min, math.ceil(p_need - 1e-9)))
    d = min(bounds.decode_max, max(bounds.decode_min, math.ceil(d_need - 1e-9)))
    return Replicas(*within_band(p, d, bounds))


def recommend(load: Load, prefill: PrefillModel, decode: DecodeModel, targets: Targets,
              bounds: Bounds) -> Recommendation:
    """The replicas this interval's load needs, clamped and kept in the ratio band."""
    p_need, p_why = prefill_need(load, prefill, targets.ttft_p90_s)
    d_need, d_why = decode_need(load, decode, targets.itl_p90_s)
    p_steady, _ = prefill_need(load, prefill, targets.ttft_p90_s, backlog_drain_s=None)
    d_steady, _ = decode_need(load, decode, targets.itl_p90_s, steady=True)
    steady = bounded(p_steady, d_steady, bounds)
    if p_need <= p_steady * (1 + BACKLOG_EXPLAINS_TTFT):
        p_need *= correction(load.ttft_p90_s, targets.ttft_p90_s)
    d_need *= correction(load.itl_p90_s, targets.itl_p90_s)
    return Recommendation(bounded(p_need, d_need, bounds), p_need, d_need,
                          f"prefill: {p_why}; decode: {d_why}", steady)


@dataclass
class Stabiliser:
    """Scale up at once; scale down only to the highest steady recommendation of the last
    `window_s` seconds, and by at most `step` instances per decision."""
    window_s: float
    step: int = 1
    _history: deque[tuple[float, int]] = field(default_factory=deque)

    def seed(self, now: float, count: int) -> None:
        """Count `count` as recommended at `now` (a driver that restarts with a decision)."""
        self._history.append((now, count))

    def settle(self, now: float, recommended: int, current: int,
               steady: int | None = None) -> int:
        """`steady`: the part of `recommended` that is not transient (default: all of it)."""
        self._history.append((now, recommended if steady is None else min(steady, recommended)))
        while self._history and self._history[0][0] < now - self.window_s:
            self._history.popleft()
        if recommended >= current:
            return recommended
        floor = max(r for _, r in self._history)
        recent = [r for _, r in list(self._history)[-FAST_DROP_DECISIONS:]]
        if len(recent) == FAST_DROP_DECISIONS and max(recent) <= FAST_DROP_SHARE * current:
            floor = max(recent)
        return max(floor, current - self.step) if floor < current else current


@dataclass
class Planner:
    """`recommend` with stabilisation per role: what a driver calls every interval."""
    prefill: PrefillModel
    decode: DecodeModel
    targets: Targets
    bounds: Bounds = field(default_factory=Bounds)
    scale_down_window_s: float = 300.0
    scale_down_step: int = 1
    transient_scale_down: bool = True

    def __post_init__(self) -> None:
        self._stabilisers = {role: Stabiliser(self.scale_down_window_s, self.scale_down_step)
                             for role in ("prefill", "decode")}
        # One saturated prefill instance's prompt tokens per second, for the last decision's
        # prompts (their cached and uncached lengths), and its p90 prompt's own prefill time.
        self._prefill_tokens_per_s: float | None = None
        self._slow_prompt_s = 0.0

    def seed(self, now: float, role: str, count: int) -> None:
        self._stabilisers[role].seed(now, count)

    def queue_wait_s(self, queued_uncached_tokens: float, prefill_instances: int
                     ) -> float | None:
        """How long the prefill instances take to work off the prompt tokens queued now, at
        the throughput the last decision's prompts get; None before a decision saw prompts."""
        if self._prefill_tokens_per_s is None:
            return None
        return queued_uncached_tokens / (max(prefill_instances, 1) * self._prefill_tokens_per_s)

    def queue_budget_s(self) -> float:
        """The wait a queue may add: what the TTFT target leaves after the last decision's p90
        prompt's own prefill, at least QUEUE_WAIT_FLOOR_SHARE of the target."""
        target = self.targets.ttft_p90_s
        return max(target - self._slow_prompt_s, QUEUE_WAIT_FLOOR_SHARE * target)

    def queue_breaks_ttft(self, queued_uncached_tokens: float, prefill_instances: int) -> bool:
        """The queue makes a p90 prompt arriving now miss the TTFT target: a driver then asks
        `scale_up` now rather than waiting for the next interval."""
        wait = self.queue_wait_s(queued_uncached_tokens, prefill_instances)
        return wait is not None and wait > self.queue_budget_s()

    def scale_up(self, load: Load, current: Replicas) -> Recommendation:
        """Between decisions: the load so far's recommendation where it adds instances, the
        current count elsewhere. The stabilisers do not record it: the next decision, on the
        whole interval, says what stays."""
        raw = recommend(load, self.prefill, self.decode, self.targets, self.bounds)
        up = Replicas(max(raw.replicas.prefill, current.prefill),
                      max(raw.replicas.decode, current.decode))
        return Recommendation(up, raw.prefill_need, raw.decode_need,
                              f"the prefill queue breaks the TTFT target; {raw.reason}",
                              raw.steady)

    def decide(self, now: float, load: Load, current: Replicas) -> Recommendation:
        if load.requests_per_s > 0 and load.uncached_tokens_per_s > 0:
            uncached_mean = load.uncached_tokens_per_s / load.requests_per_s
            self._prefill_tokens_per_s = self.prefill.tokens_per_second(
                load.cached_tokens_mean, uncached_mean)
            self._slow_prompt_s = p90_prompt_seconds(load, self.prefill)
        raw = recommend(load, self.prefill, self.decode, self.targets, self.bounds)
        steady = raw.steady if self.transient_scale_down else None
        settled = Replicas(
            self._stabilisers["prefill"].settle(now, raw.replicas.prefill, current.prefill,
                                                None if steady is None else steady.prefill),
            self._stabilisers["decode"].settle(now, raw.replicas.decode, current.decode,
                                               None if steady is None else steady.decode))
        return Recommendation(settled, raw.prefill_need, raw.decode_need, raw.reason,
                              raw.steady)
