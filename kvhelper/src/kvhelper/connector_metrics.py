"""The connector's numbers, carried by vLLM's own connector-stats path: workers hand a
`TransferStats` to vLLM after each step, vLLM sums them across workers and steps, logs them
("KV Transfer metrics: ...") and feeds `TransferPromMetrics`, which serves them on the
instance's `/metrics` as `vllm:kvhelper_*`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)
from vllm.v1.metrics.utils import create_metric_per_engine

COUNTERS = {
    "requests_loaded": "Requests whose KV was loaded from the store in full",
    "requests_load_failed": "Requests with at least one KV page missing or unreadable",
    "requests_refused": "Requests whose prefill was incompatible with this instance",
    "blocks_loaded": "KV blocks loaded from the store",
    "blocks_load_failed": "KV blocks that could not be loaded (recomputed or failed by policy)",
    "bytes_loaded": "KV bytes loaded from the store",
    # Stored per store value: one per block, or per block and head shard when a rank's pages
    # are split into several (store_tp_size above the TP size).
    "blocks_stored": "KV block values stored",
    "blocks_skipped": "KV block values not stored because the store already had them",
    "blocks_store_failed": "KV block values that could not be stored",
    "bytes_stored": "KV bytes stored",
    # Prefill's own lookups: new prompts looked up in the store, and leading blocks found.
    "lookups": "New prompts looked up in the store before computing them",
    "lookup_hit_blocks": "Leading KV blocks of looked-up prompts found in the store (loaded)",
    "lookups_failed": "Lookups the store could not answer (the prompt was computed)",
    "lookup_hints": "New prompts whose stored blocks the proxy had found (no lookup here)",
    # Decode saving (save_decode_cache): finished requests stored, and the bytes that took.
    "decode_saves": "Finished requests whose prompt and generated blocks were stored",
    "decode_bytes_stored": "KV bytes stored for finished requests (decode saving)",
}
DURATIONS = {
    "load_seconds": "Time to load one request's KV (store read and scatter into the cache)",
    "store_seconds": "Time to store one request's KV (gather, existence check and write)",
    "lookup_seconds": "Time to look up one new prompt's leading blocks in the store",
    "store_wait_seconds": "Time a load waited for pages that prefill was still storing",
}
BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0]


def empty() -> dict[str, Any]:
    return {**dict.fromkeys(COUNTERS, 0), **{name: [] for name in DURATIONS}}


@dataclass
class TransferStats(KVConnectorStats):
    """Counters and per-request durations since the last hand-over; plain data, so it
    pickles from the worker to the engine's logger."""

    def __post_init__(self) -> None:
        self.data = {**empty(), **self.data}

    def count(self, name: str, amount: int = 1) -> None:
        self.data[name] += amount

    def observe(self, name: str, seconds: float) -> None:
        self.data[name].append(seconds)

    def reset(self) -> None:
        self.data = empty()

    def take(self) -> TransferStats | None:
        """This interval's numbers (None when nothing happened), and start a new interval."""
        if self.is_empty():
            return None
        taken = TransferStats(data=self.data)
        self.reset()
        return taken

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name in COUNTERS:
            self.data[name] += other.data.get(name, 0)
        for name in DURATIONS:
            self.data[name] = [*self.data[name], *other.data.get(name, [])]
        return self

    def reduce(self) -> dict[str, int | float]:
        reduced: dict[str, int | float] = {name: self.data[name] for name in COUNTERS
                                           if self.data[name]}
        for name in DURATIONS:
            if self.data[name]:
                reduced[f"avg_{name.removesuffix('_seconds')}_ms"] = round(
                    1000 * sum(self.data[name]) / len(self.data[name]), 3)
        return reduced

    def is_empty(self) -> bool:
        return not any(self.data[name] for name in (*COUNTERS, *DURATIONS))


class TransferPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        # vLLM hands in its own (possibly multiprocess-aware) metric classes.
        counter: Any = self._counter_cls
        histogram: Any = self._histogram_cls
        self.counters: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                counter(name=f"vllm:kvhelper_{name}", documentation=doc,
                                  labelnames=labelnames), per_engine_labelvalues)
            for name, doc in COUNTERS.items()}
        self.histograms: dict[str, dict[int, Any]] = {
            name: create_metric_per_engine(
                histogram(name=f"vllm:kvhelper_{name}", documentation=doc,
                                    buckets=BUCKETS, labelnames=labelnames),
                per_engine_labelvalues)
            for name, doc in DURATIONS.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, per_engine in self.counters.items():
            if transfer_stats_data.get(name):
                per_engine[engine_idx].inc(transfer_stats_data[name])
        for name, per_engine in self.histograms.items():
            for seconds in transfer_stats_data.get(name, []):
                per_engine[engine_idx].observe(seconds)
