"""The planner's Load from two scrapes of the serving pods' metrics. Pure.

A scrape holds, per pod, the counters, gauges and histograms the planner reads: vLLM's own
(prefill and decode instances) and the proxy's client-side time to first token. Counters and
histograms are differenced per pod between the two scrapes (a pod that is new, or restarted
and so reset its counters, counts from zero); gauges are read at the later scrape.

What each Load field comes from:
- uncached prompt tokens, their spread and the cached share: prefill instances'
  `vllm:request_prefill_kv_computed_tokens` (tokens each request computed) against
  `vllm:prompt_tokens` (tokens it was sent);
- request rate: the proxy's `disagg_proxy_requests_arrived_total`, requests as they arrive
  (the simulator's arrival rate; decode's finished requests lag a whole generation behind);
  from a proxy without it, decode's finished requests;
- prompt and output lengths: decode instances' `vllm:request_prompt_tokens` and
  `vllm:request_generation_tokens` (one observation per finished request);
- ITL p90: decode's `vllm:inter_token_latency_seconds`; TTFT p90: the proxy's
  `disagg_proxy_time_to_first_token_seconds` (what clients see, prefill included);
- KV demand: decode's `vllm:kv_cache_usage_perc` times its KV capacity (`vllm:cache_config_info`)
  per engine, plus its waiting requests at the mean request length: the 90th percentile over
  the samples taken during the interval (`kv_samples`, as the simulator samples every 5 s) and
  the later scrape; the prefill backlog: prefill's `vllm:num_requests_waiting` at the mean
  uncached length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from disagg_operator.planner import Load

PREFILL_COMPUTED = "vllm:request_prefill_kv_computed_tokens"
PROMPT_TOKENS = "vllm:prompt_tokens"
REQUEST_PROMPT = "vllm:request_prompt_tokens"
REQUEST_OUTPUT = "vllm:request_generation_tokens"
INTER_TOKEN = "vllm:inter_token_latency_seconds"
KV_USAGE = "vllm:kv_cache_usage_perc"
WAITING = "vllm:num_requests_waiting"
CACHE_CONFIG = "vllm:cache_config_info"
PROXY_TTFT = "disagg_proxy_time_to_first_token_seconds"
PROXY_ARRIVED = "disagg_proxy_requests_arrived"
# Disaggregation silently lost (disagg_operator.transfer_health): requests decode answered
# alone, and decode's KV loads, whole or failed.
PROXY_DECODE_ALONE = "disagg_proxy_decode_alone"
KV_LOADS = "vllm:kvhelper_requests_loaded"
KV_LOADS_FAILED = "vllm:kvhelper_requests_load_failed"

COUNTERS = (PROMPT_TOKENS, PROXY_ARRIVED, PROXY_DECODE_ALONE, KV_LOADS, KV_LOADS_FAILED)
GAUGES = (WAITING,)
HISTOGRAMS = (PREFILL_COMPUTED, REQUEST_PROMPT, REQUEST_OUTPUT, INTER_TOKEN, PROXY_TTFT)


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram: cumulative counts per upper bound (the last is +Inf)."""

    bounds: tuple[float, ...]
    cumulative: tuple[float, ...]
    total: float  # the sum of observations

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        """The observations since `earlier`; all of them if it is gone, reset or re-bucketed."""
        if (earlier is None or earlier.bounds != self.bounds or earlier.count > self.count):
            return self
        return Histogram(self.bounds, tuple(a - b for a, b in zip(
            self.cumulative, earlier.cumulative, strict=True)), self.total - earlier.total)

    def plus(self, other: Histogram) -> Histogram:
        if not self.bounds:
            return other
        if other.bounds != self.bounds:
            raise ValueError("histograms with different buckets cannot be added")
        return Histogram(self.bounds, tuple(a + b for a, b in zip(
            self.cumulative, other.cumulative, strict=True)), self.total + other.total)

    def quantile(self, q: float) -> float | None:
        """Linear within the bucket, as PromQL's histogram_quantile; None when empty. A rank
        in the +Inf bucket gives the highest finite bound."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            if cumulative >= rank and cumulative > below:
                if math.isinf(bound):
                    return lower
                return lower + (bound - lower) * (rank - below) / (cumulative - below)
            if not math.isinf(bound):
                lower = bound
            below = cumulative
        return lower

    def cv2(self) -> float | None:
        """The squared coefficient of variation, with each observation at its bucket's middle
        (the +Inf bucket's at its lower bound) and the mean from the exact sum."""
        if self.count <= 1 or self.total <= 0:
            return None
        mean = self.total / self.count
        lower, below, square = 0.0, 0.0, 0.0
        for bound, cumulative in zip(self.bounds, self.cumulative, strict=True):
            middle = lower if math.isinf(bound) else (lower + bound) / 2
            square += (cumulative - below) * (middle - mean) ** 2
            if not math.isinf(bound):
                lower = bound
            below = cumulative
        return square / self.count / mean ** 2


EMPTY = Histogram((), (), 0.0)


@dataclass(frozen=True)
class PodMetrics:
    """One pod's metrics, summed over label sets (a pod may run several engines)."""

    role: str  # prefill, decode or proxy
    values: Mapping[str, float] = field(default_factory=dict)  # counters and gauges
    histograms: Mapping[str, Histogram] = field(default_factory=dict)
    # KV tokens held now: each engine's KV usage times its capacity (num_gpu_blocks x
    # block_size from vLLM's cache_config_info).
    kv_tokens_used: float = 0.0


@dataclass(frozen=True)
class Scrape:
    at: float  # seconds on the driver's monotonic clock
    pods: Mapping[str, PodMetrics]  # by pod name

    def roles(self) -> set[str]:
        return {pod.role for pod in self.pods.values()}


def _delta_histogram(before: Scrape, after: Scrape, role: str, name: str) -> Histogram:
    total = EMPTY
    for pod_name, pod in after.pods.items():
        if pod.role != role or name not in pod.histograms:
            continue
        earlier = before.pods.get(pod_name)
        total = total.plus(pod.histograms[name].minus(
            earlier.histograms.get(name) if earlier is not None else None))
    return total


def delta_counter(before: Scrape, after: Scrape, role: str, name: str) -> float:
    """A counter's growth between two scrapes, summed over the role's pods (a pod that
    restarted counts from zero)."""
    total = 0.0
    for pod_name, pod in after.pods.items():
        if pod.role != role or name not in pod.values:
            continue
        earlier = before.pods.get(pod_name)
        start = earlier.values.get(name, 0.0) if earlier is not None else 0.0
        now = pod.values[name]
        total += now - start if now >= start else now
    return total


def _gauge(scrape: Scrape, role: str, name: str) -> float:
    return sum(p.values.get(name, 0.0) for p in scrape.pods.values() if p.role == role)


@dataclass(frozen=True)
class KvSample:
    """Decode's KV at one moment: tokens held, and requests waiting for room."""
    held_tokens: float
    waiting: float


def kv_sample(scrape: Scrape) -> KvSample:
    return KvSample(sum(p.kv_tokens_used for p in scrape.pods.values() if p.role == "decode"),
                    _gauge(scrape, "decode", WAITING))


def prompts_waiting(scrape: Scrape) -> float:
    """Requests queued at the prefill instances, not yet scheduled."""
    return _gauge(scrape, "prefill", WAITING)


def _p90(values: list[float]) -> float:
    """Nearest rank, as the simulator's driver takes it of its samples."""
    ordered = sorted(values)
    return ordered[int(0.9 * (len(ordered) - 1))]


def load_between(before: Scrape, after: Scrape, kv_samples: Sequence[KvSample] = ()) -> Load:
    """The load of the interval between two scrapes, as the planner reads it; `kv_samples`:
    decode's KV sampled in between."""
    seconds = max(after.at - before.at, 1e-9)
    computed = _delta_histogram(before, after, "prefill", PREFILL_COMPUTED)
    sent = delta_counter(before, after, "prefill", PROMPT_TOKENS)
    prompts = _delta_histogram(before, after, "decode", REQUEST_PROMPT)
    outputs = _delta_histogram(before, after, "decode", REQUEST_OUTPUT)
    prefilled = computed.count
    uncached_per_request = computed.total / prefilled if prefilled else 0.0
    prompt_mean = prompts.total / prompts.count if prompts.count else 0.0
    output_mean = outputs.total / outputs.count if outputs.count else 0.0
    request_tokens = prompt_mean + output_mean
    kv_demand = _p90([sample.held_tokens + sample.waiting * request_tokens
                      for sample in [*kv_samples, kv_sample(after)]])
    counts_arrivals = any(PROXY_ARRIVED in pod.values for pod in after.pods.values()
                          if pod.role == "proxy")
    requests = (delta_counter(before, after, "proxy", PROXY_ARRIVED) if counts_arrivals
                else prompts.count)
    return Load(
        requests_per_s=requests / seconds,
        uncached_tokens_per_s=computed.total / seconds,
        cached_tokens_mean=max(0.0, sent - computed.total) / prefilled if prefilled else 0.0,
        prompt_tokens_mean=prompt_mean,
        output_tokens_mean=output_mean,
        ttft_p90_s=_delta_histogram(before, after, "proxy", PROXY_TTFT).quantile(0.9),
        itl_p90_s=_delta_histogram(before, after, "decode", INTER_TOKEN).quantile(0.9),
        kv_tokens_demand=kv_demand,
        uncached_tokens_p90=computed.quantile(0.9),
        uncached_tokens_cv2=computed.cv2() or 1.0,
        queued_uncached_tokens=prompts_waiting(after) * uncached_per_request)


def load_fields(load: Load) -> dict[str, float]:
    """The load as the status shows it (camelCase, rounded, unset fields left out)."""
    shown = {
        "requestsPerSecond": load.requests_per_s,
        "uncachedTokensPerSecond": load.uncached_tokens_per_s,
        "cachedTokensMean": load.cached_tokens_mean,
        "promptTokensMean": load.prompt_tokens_mean,
        "outputTokensMean": load.output_tokens_mean,
        "ttftP90Seconds": load.ttft_p90_s,
        "itlP90Seconds": load.itl_p90_s,
        "kvTokensDemand": load.kv_tokens_demand,
        "queuedUncachedTokens": load.queued_uncached_tokens,
    }
    return {k: round(v, 4) for k, v in shown.items() if v is not None}
