"""The rationed blocking wait the proxy's event loop uses for store lookups (brief_wait.py)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future

import pytest
from kvhelper.proxy.brief_wait import BriefWait


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_waits_are_capped_each_and_rationed_to_a_share_of_the_time() -> None:
    clock = Clock()
    wait = BriefWait(share=0.05, longest_s=0.002, burst_s=0.01, clock=clock)
    assert wait.allowance() == pytest.approx(0.002)  # saved up while idle, capped per wait
    wait.spend(0.01)  # the burst spent: nothing left
    assert wait.allowance() == 0.0
    clock.now += 0.02  # 5% of 20 ms
    assert wait.allowance() == pytest.approx(0.001)
    clock.now += 10.0  # idle long: the saving stops at the burst
    wait.spend(0.0)
    assert wait.allowance() == pytest.approx(0.002)
    wait.spend(0.008)
    assert wait.allowance() == pytest.approx(0.002)
    wait.spend(0.002)
    assert wait.allowance() == 0.0


def test_an_answer_within_the_allowance_is_taken_and_a_late_one_is_left() -> None:
    wait = BriefWait(longest_s=0.05, burst_s=0.05, share=1.0)
    soon: Future[int] = Future()
    threading.Timer(0.001, soon.set_result, [3]).start()
    assert wait.done_soon(soon) and soon.result() == 3
    late: Future[int] = Future()
    began = time.perf_counter()
    assert not wait.done_soon(late)
    assert 0.04 < time.perf_counter() - began < 0.2  # blocked for the allowance, no longer
    never: Future[int] = Future()
    rationed = BriefWait(longest_s=0.01, burst_s=0.01, share=0.0)
    assert not rationed.done_soon(never)
    began = time.perf_counter()
    assert not rationed.done_soon(never)  # its time is spent: it does not block at all
    assert time.perf_counter() - began < 0.005
