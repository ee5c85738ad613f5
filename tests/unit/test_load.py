"""The planner's Load from two scrapes of metrics pages in vLLM's and the proxy's format."""

import math

import pytest
from disagg_devtools.emulator.metric_pages import EnginePage, ProxyPage
from disagg_operator.load import Histogram, PodMetrics, Scrape, load_between
from disagg_operator.metrics_scrape import parse_pod_metrics


def _scrape(at: float, pages: dict[str, tuple[str, EnginePage | ProxyPage]]) -> Scrape:
    return Scrape(at, {name: parse_pod_metrics(role, page.page().decode())
                       for name, (role, page) in pages.items()})


def test_quantile_interpolates_within_the_bucket_like_promql() -> None:
    h = Histogram((1.0, 2.0, 4.0, math.inf), (10.0, 30.0, 40.0, 40.0), 70.0)
    assert h.quantile(0.25) == pytest.approx(1.0)  # rank 10: the end of the first bucket
    assert h.quantile(0.5) == pytest.approx(1.5)  # rank 20: half way through (1, 2]
    assert h.quantile(0.9) == pytest.approx(3.2)  # rank 36: 6 of 10 in (2, 4]
    assert Histogram((1.0, math.inf), (0.0, 5.0), 50.0).quantile(0.9) == 1.0  # all in +Inf
    assert Histogram((1.0, math.inf), (0.0, 0.0), 0.0).quantile(0.9) is None


def test_a_reset_or_new_pod_counts_from_zero() -> None:
    before = Histogram((1.0, math.inf), (5.0, 8.0), 9.0)
    after_restart = Histogram((1.0, math.inf), (1.0, 2.0), 3.0)
    assert after_restart.minus(before) == after_restart
    assert after_restart.minus(None) == after_restart
    grown = Histogram((1.0, math.inf), (7.0, 12.0), 20.0)
    assert grown.minus(before) == Histogram((1.0, math.inf), (2.0, 4.0), 11.0)


def test_load_between_two_scrapes_reads_each_role_from_its_own_pods() -> None:
    prefill, decode, proxy = EnginePage(), EnginePage(num_gpu_blocks=1000, block_size=16), \
        ProxyPage()
    pages = {"p-0": ("prefill", prefill), "d-0": ("decode", decode), "x-0": ("proxy", proxy)}
    prefill.served(prompt=300, computed=280, output=1, itl_s=0.0)  # before the interval
    first = _scrape(100.0, pages)
    for _ in range(20):  # 20 requests of 400 prompt tokens, 100 of them cached
        prefill.served(prompt=400, computed=300, output=1, itl_s=0.0)
        decode.served(prompt=400, computed=0, output=50, itl_s=0.04)
        proxy.arrived.inc()
        proxy.ttft.observe(0.3)
    decode.kv_usage.set(0.5)  # 8,000 of 16,000 tokens
    decode.waiting.set(2)
    prefill.waiting.set(3)
    load = load_between(first, _scrape(110.0, pages))
    assert load.requests_per_s == pytest.approx(2.0)
    assert load.uncached_tokens_per_s == pytest.approx(600.0)
    assert load.cached_tokens_mean == pytest.approx(100.0)
    assert (load.prompt_tokens_mean, load.output_tokens_mean) == (400.0, 50.0)
    assert 0.25 < load.ttft_p90_s <= 0.5  # the bucket (0.25, 0.5] holds every observation
    assert 0.025 < load.itl_p90_s <= 0.05
    assert load.kv_tokens_demand == pytest.approx(8000 + 2 * 450)
    assert load.queued_uncached_tokens == pytest.approx(3 * 300)
    assert 200 < load.uncached_tokens_p90 <= 500


def test_the_request_rate_is_the_proxys_arrivals_not_decodes_finished_requests() -> None:
    """As the simulator counts it: an interval in which prompts arrived and were prefilled
    while decode finished none (long outputs) has their rate, not zero, so the planner's mean
    uncached prompt (uncached tokens / requests) stays the prompts' own."""
    prefill, decode, proxy = EnginePage(), EnginePage(), ProxyPage()
    pages = {"p-0": ("prefill", prefill), "d-0": ("decode", decode), "x-0": ("proxy", proxy)}
    first = _scrape(0.0, pages)
    for _ in range(30):
        proxy.arrived.inc()
        prefill.served(prompt=500, computed=500, output=1, itl_s=0.0)
    load = load_between(first, _scrape(10.0, pages))
    assert load.requests_per_s == pytest.approx(3.0)
    assert load.uncached_tokens_per_s / load.requests_per_s == pytest.approx(500.0)
    # A proxy too old to count arrivals: decode's finished requests, as before.
    old = {"p-0": ("prefill", prefill), "d-0": ("decode", decode)}
    before = _scrape(0.0, old)
    decode.served(prompt=500, computed=0, output=8, itl_s=0.01)
    assert load_between(before, _scrape(10.0, old)).requests_per_s == pytest.approx(0.1)


def test_without_traffic_the_load_is_zero_and_latencies_unknown() -> None:
    pages = {"p-0": ("prefill", EnginePage()), "d-0": ("decode", EnginePage())}
    load = load_between(_scrape(0.0, pages), _scrape(60.0, pages))
    assert (load.requests_per_s, load.uncached_tokens_per_s) == (0.0, 0.0)
    assert load.ttft_p90_s is None and load.itl_p90_s is None


def test_a_page_that_is_not_prometheus_text_is_refused() -> None:
    with pytest.raises(ValueError):
        parse_pod_metrics("decode", "<html>not metrics</html>\n{")
    assert PodMetrics("decode").kv_tokens_used == 0.0
