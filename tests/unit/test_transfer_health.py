"""The verdict on whether P/D really happened over an interval (disagg_operator.transfer_health)."""

from disagg_operator.load import PodMetrics, Scrape
from disagg_operator.transfer_health import assess


def scrape(at: float, arrived: float, alone: float, loaded: float, failed: float) -> Scrape:
    return Scrape(at, {
        "proxy-a": PodMetrics("proxy", {"disagg_proxy_requests_arrived": arrived,
                                        "disagg_proxy_decode_alone": alone}),
        "decode-a": PodMetrics("decode", {"vllm:kvhelper_requests_loaded": loaded,
                                          "vllm:kvhelper_requests_load_failed": failed})})


def test_too_few_requests_say_nothing() -> None:
    assert assess(scrape(0, 0, 0, 0, 0), scrape(60, 4, 4, 0, 0)) is None


def test_decode_alone_beyond_a_tenth_of_requests_is_degraded() -> None:
    verdict = assess(scrape(0, 100, 0, 100, 0), scrape(60, 120, 3, 117, 0))
    assert verdict is not None and not verdict.healthy and verdict.reason == "DecodeAlone"
    assert "3 of 20 requests in the last 60 s" in verdict.message
    fine = assess(scrape(0, 100, 0, 100, 0), scrape(60, 120, 2, 118, 0))
    assert fine is not None and fine.healthy


def test_failed_loads_beyond_a_tenth_are_degraded_and_a_restarted_pod_counts_from_zero() -> None:
    verdict = assess(scrape(0, 50, 0, 500, 40), scrape(30, 70, 0, 16, 4))  # decode restarted
    assert verdict is not None and verdict.reason == "KVLoadsFailing"
    assert "4 of 20 KV loads" in verdict.message
