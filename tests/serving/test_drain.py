"""The preStop drain: it waits for a quiet spell, restarts the count on new work, and gives up
at its timeout."""

from __future__ import annotations

from collections.abc import Iterator

from kvhelper.drain import drain, requests_in_flight


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def readings(*values: float | None) -> Iterator[float | None]:
    yield from values
    while True:
        yield values[-1]


def test_it_waits_until_nothing_has_run_for_the_quiet_spell() -> None:
    clock = FakeClock()
    # Busy for 2 s, idle 1 s, a late request routed here for 1 s, then idle.
    values = readings(*[3] * 4, *[0] * 2, *[1] * 2, 0)
    why = drain(lambda: next(values), quiet=5, timeout=60, interval=0.5, clock=clock,
                sleep=clock.sleep)
    assert why == "idle for 5s" and clock.now == 4.0 + 5.0


def test_it_gives_up_at_its_timeout_and_stops_when_the_server_is_gone() -> None:
    clock = FakeClock()
    why = drain(lambda: 2, quiet=5, timeout=30, interval=0.5, clock=clock, sleep=clock.sleep)
    assert why.startswith("gave up after 30s with 2 requests") and clock.now == 30
    assert drain(lambda: None, 5, 30) == "the server is not answering"


def test_running_and_waiting_requests_are_read_from_vllms_metrics() -> None:
    text = "\n".join([
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        'vllm:num_requests_running{engine="0",model_name="m"} 2.0',
        'vllm:num_requests_waiting{engine="0",model_name="m"} 1.0',
        'vllm:num_requests_swapped{engine="0",model_name="m"} 7.0'])
    assert requests_in_flight(text) == 3.0
