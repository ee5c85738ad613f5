"""Stand-ins for the serving pods' /metrics pages, for the emulator, whose pods run nothing.

The families, labels and bucket layouts are the ones the real pages have (vLLM's for prefill
and decode instances, kvhelper's proxy for the time to first token); the planner's scrape of
real pages is tested against a real local deployment (tests/serving/test_local_e2e.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM sizes its token histograms 1-2-5 up to max_model_len.
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
TTFT_BUCKETS = (.025, .05, .1, .25, .5, .75, 1, 1.5, 2, 3, 4, 6, 8, 10, 15, 20, 30, 60, 120)


class EnginePage:
    """One vLLM engine's metrics, as its API server exports them."""

    def __init__(self, model: str = "tiny", num_gpu_blocks: int = 1000,
                 block_size: int = 16) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        self._labels = (model, "0")
        r = self.registry
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens.", labels,
                                     registry=r).labels(*self._labels)
        self.computed = Histogram("vllm:request_prefill_kv_computed_tokens", "Computed.",
                                  labels, buckets=TOKEN_BUCKETS, registry=r).labels(*self._labels)
        self.request_prompt = Histogram("vllm:request_prompt_tokens", "Prompt.", labels,
                                        buckets=TOKEN_BUCKETS, registry=r).labels(*self._labels)
        self.request_output = Histogram("vllm:request_generation_tokens", "Output.", labels,
                                        buckets=TOKEN_BUCKETS, registry=r).labels(*self._labels)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "ITL.", labels,
                             buckets=ITL_BUCKETS, registry=r).labels(*self._labels)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV usage.", labels,
                              registry=r).labels(*self._labels)
        self.waiting = Gauge("vllm:num_requests_waiting", "Waiting.", labels,
                             registry=r).labels(*self._labels)
        self.loads = Counter("vllm:kvhelper_requests_loaded", "KV loaded in full.", labels,
                             registry=r).labels(*self._labels)
        self.loads_failed = Counter("vllm:kvhelper_requests_load_failed", "KV loads failed.",
                                    labels, registry=r).labels(*self._labels)
        Gauge("vllm:cache_config_info", "Cache config.",
              ["block_size", "num_gpu_blocks", "engine"], registry=r).labels(
            str(block_size), str(num_gpu_blocks), "0").set(1)

    def served(self, prompt: int, computed: int, output: int, itl_s: float) -> None:
        """One finished request: prompt tokens sent, computed here, tokens generated."""
        self.prompt_tokens.inc(prompt)
        self.computed.observe(computed)
        self.request_prompt.observe(prompt)
        self.request_output.observe(output)
        for _ in range(max(0, output - 1)):
            self.itl.observe(itl_s)

    def page(self) -> bytes:
        return generate_latest(self.registry)


class ProxyPage:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram("disagg_proxy_time_to_first_token_seconds", "TTFT.",
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.arrived = Counter("disagg_proxy_requests_arrived", "Requests received.",
                               registry=self.registry)
        self.decode_alone = Counter("disagg_proxy_decode_alone", "Answered by decode alone.",
                                    ["reason"], registry=self.registry).labels(
            "no_compatible_prefill")

    def page(self) -> bytes:
        return generate_latest(self.registry)


@dataclass
class MetricPagesServer:
    """Serves each page at /<name>/metrics on one loopback port; `address(name)` is the
    host:port/<name> a scraper override points a pod at."""

    pages: Mapping[str, EnginePage | ProxyPage]
    _runner: web.AppRunner | None = field(default=None, init=False)
    port: int = field(default=0, init=False)

    async def start(self) -> MetricPagesServer:
        app = web.Application()
        app.router.add_get("/{name}/metrics", self._serve)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    def address(self, name: str) -> str:
        return f"127.0.0.1:{self.port}/{name}"

    async def _serve(self, request: web.Request) -> web.Response:
        page = self.pages.get(request.match_info["name"])
        if page is None:
            raise web.HTTPNotFound()
        return web.Response(body=page.page(), content_type="text/plain")
