"""Whether prefill/decode is really happening, from the serving pods' counters: the status's
`Degraded` condition says so when it silently is not. Pure; `TransferMonitor` scrapes.

Two ways P/D degrades while every pod reports healthy: the proxy answers requests with decode
alone (no compatible prefill instance: `disagg_proxy_decode_alone_total`), and decode's KV loads
fail so that it recomputes the prompt (`vllm:kvhelper_requests_load_failed_total`). Each is
judged over the interval between two scrapes, once enough requests passed to say."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagg_operator.autoscaler import MetricsSource, scrape_targets
from disagg_operator.load import (
    KV_LOADS,
    KV_LOADS_FAILED,
    PROXY_ARRIVED,
    PROXY_DECODE_ALONE,
    Scrape,
    delta_counter,
)
from disagg_operator.render import Manifest
from disagg_operator.spec import DisaggServingSpec

MIN_REQUESTS = 5  # fewer in an interval say nothing either way
MAX_SHARE = 0.1  # more than this share of requests degraded: say so


@dataclass(frozen=True)
class TransferHealth:
    healthy: bool
    reason: str
    message: str


def assess(earlier: Scrape, now: Scrape) -> TransferHealth | None:
    """The verdict on the interval between two scrapes; None when too little passed."""
    seconds = now.at - earlier.at
    arrived = delta_counter(earlier, now, "proxy", PROXY_ARRIVED)
    alone = delta_counter(earlier, now, "proxy", PROXY_DECODE_ALONE)
    loaded = delta_counter(earlier, now, "decode", KV_LOADS)
    failed = delta_counter(earlier, now, "decode", KV_LOADS_FAILED)
    if arrived >= MIN_REQUESTS and alone > MAX_SHARE * arrived:
        return TransferHealth(False, "DecodeAlone", (
            f"{alone:.0f} of {arrived:.0f} requests in the last {seconds:.0f} s were answered "
            "by decode alone, without prefill (no prefill instance it could pair with): check "
            "the prefill pods and their registration (the proxy's /instances, "
            "disagg_proxy_decode_alone_total by reason)"))
    if loaded + failed >= MIN_REQUESTS and failed > MAX_SHARE * (loaded + failed):
        return TransferHealth(False, "KVLoadsFailing", (
            f"{failed:.0f} of {loaded + failed:.0f} KV loads on decode in the last "
            f"{seconds:.0f} s failed, and those prompts were recomputed: check the Mooncake "
            "master and store (vllm:kvhelper_blocks_load_failed_total, the decode logs)"))
    if arrived >= MIN_REQUESTS or loaded + failed >= MIN_REQUESTS:
        return TransferHealth(True, "Transferring", (
            f"{arrived - alone:.0f} of {arrived:.0f} requests prefilled and decoded apart in "
            f"the last {seconds:.0f} s"))
    return None


class TransferMonitor:
    """Per DisaggServing: scrapes the proxy and decode pods at most every `window_seconds`
    and keeps the last verdict (an interval with too little traffic keeps it)."""

    def __init__(self, source: MetricsSource, window_seconds: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.source, self.window_seconds, self.clock = source, window_seconds, clock
        self._last: dict[str, Scrape] = {}
        self._verdict: dict[str, TransferHealth] = {}

    async def check(self, uid: str, spec: DisaggServingSpec,
                    pods: Sequence[Manifest]) -> TransferHealth | None:
        earlier = self._last.get(uid)
        if earlier is not None and self.clock() - earlier.at < self.window_seconds:
            return self._verdict.get(uid)
        targets = [t for t in scrape_targets(spec, pods) if t.role in ("proxy", "decode")]
        if not targets:
            return self._verdict.get(uid)
        now = await self.source.scrape(targets)
        self._last[uid] = now
        if earlier is not None and (verdict := assess(earlier, now)) is not None:
            self._verdict[uid] = verdict
        return self._verdict.get(uid)

    def forget(self, uid: str) -> None:
        self._last.pop(uid, None)
        self._verdict.pop(uid, None)
