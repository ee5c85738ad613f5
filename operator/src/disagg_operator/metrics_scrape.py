"""Scrape the serving pods' Prometheus metrics into the planner's Scrape (disagg_operator.load).

Every pod is asked at once, each within a timeout; a pod that does not answer is left out
of the scrape (and logged), never an error: the planner then decides on what did answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import aiohttp
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from disagg_operator.autoscaler import ScrapeTarget
from disagg_operator.load import (
    CACHE_CONFIG,
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    KV_USAGE,
    Histogram,
    PodMetrics,
    Scrape,
)

log = logging.getLogger(__name__)


def parse_pod_metrics(role: str, text: str) -> PodMetrics:
    """One pod's /metrics page, reduced to what the planner reads."""
    values: dict[str, float] = defaultdict(float)
    histograms: dict[str, Histogram] = {}
    usage: dict[str, float] = {}
    capacity: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in COUNTERS or family.name in GAUGES:
            for sample in family.samples:
                if sample.name in (family.name, f"{family.name}_total"):
                    values[family.name] += sample.value
        if family.name == KV_USAGE:
            usage = {_engine(s.labels): s.value for s in family.samples}
        elif family.name == CACHE_CONFIG:
            capacity = {_engine(s.labels): _capacity(s.labels) for s in family.samples}
        elif family.name in HISTOGRAMS:
            histograms[family.name] = _histogram(family)
    used = sum(share * capacity.get(engine, 0.0) for engine, share in usage.items())
    return PodMetrics(role, dict(values), histograms, kv_tokens_used=used)


def _engine(labels: Mapping[str, str]) -> str:
    return labels.get("engine", "0")


def _capacity(labels: Mapping[str, str]) -> float:
    try:
        return float(labels["num_gpu_blocks"]) * float(labels["block_size"])
    except (KeyError, ValueError):  # "None" before the engine has sized its cache
        return 0.0


def _histogram(family: Metric) -> Histogram:
    """The family's buckets summed over its label sets (engines, models)."""
    buckets: dict[float, float] = defaultdict(float)
    total = 0.0
    for sample in family.samples:
        if sample.name.endswith("_bucket"):
            buckets[float(sample.labels["le"])] += sample.value
        elif sample.name.endswith("_sum"):
            total += sample.value
    bounds = tuple(sorted(buckets))
    return Histogram(bounds, tuple(buckets[b] for b in bounds), total)


class PodMetricsScraper:
    """GET http://<pod IP>:<port>/metrics for every target. `address_overrides` maps a pod's
    host:port to another (a test's loopback server, where pods have no routable IP)."""

    def __init__(self, timeout_s: float = 5.0,
                 address_overrides: Mapping[str, str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.address_overrides = dict(address_overrides or {})
        self.clock = clock

    async def scrape(self, targets: Sequence[ScrapeTarget]) -> Scrape:
        at = self.clock()
        async with aiohttp.ClientSession(timeout=self.timeout) as session:
            pages = await asyncio.gather(*(self._one(session, t) for t in targets))
        return Scrape(at, dict(_parsed(targets, pages)))

    async def _one(self, session: aiohttp.ClientSession, target: ScrapeTarget) -> str | None:
        address = self.address_overrides.get(target.address, target.address)
        try:
            async with session.get(f"http://{address}/metrics") as response:
                response.raise_for_status()
                return await response.text()
        except (aiohttp.ClientError, TimeoutError) as err:
            log.info("No metrics from pod %s at %s: %s", target.pod, address, err)
            return None


def _parsed(targets: Sequence[ScrapeTarget],
            pages: Iterable[str | None]) -> Iterable[tuple[str, PodMetrics]]:
    for target, page in zip(targets, pages, strict=True):
        if page is None:
            continue
        try:
            yield target.pod, parse_pod_metrics(target.role, page)
        except ValueError as err:  # not Prometheus text: another server on that port
            log.warning("Unreadable metrics from pod %s: %s", target.pod, err)
