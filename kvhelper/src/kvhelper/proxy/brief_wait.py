"""A bounded wait on the event loop's own thread for an answer another thread is about to give.

On cores that engines keep busy, handing a finished store lookup back to the event loop (the
worker thread wakes the loop through its self-pipe) waits for a scheduler tick: measured with
two busy processes on two cores, a lookup answered in 0.4 ms (p50) when the loop waits for it
itself took 2 to 4.6 ms through the hand-over. So the loop first waits for the answer itself,
briefly, and awaits it as usual only when it is late. Blocking stalls every other request
the loop serves, so the waits are rationed: each at most `longest_s`, and all together at most
`share` of the loop's time (a token bucket), so that a busy proxy goes back to plain awaiting.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

SHARE = 0.05  # of the loop's time spent blocked on lookups, at most
LONGEST_S = 0.002  # one blocking wait, at most
BURST_S = 0.01  # blocking time saved up while idle, at most


class BriefWait:
    def __init__(self, share: float = SHARE, longest_s: float = LONGEST_S,
                 burst_s: float = BURST_S,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.share, self.longest_s, self.burst_s = share, longest_s, burst_s
        self._clock = clock
        self._saved = burst_s
        self._last = clock()

    def allowance(self) -> float:
        """Seconds the next wait may block."""
        now = self._clock()
        self._saved = min(self.burst_s, self._saved + (now - self._last) * self.share)
        self._last = now
        return max(0.0, min(self.longest_s, self._saved))

    def spend(self, seconds: float) -> None:
        self._saved -= seconds

    def done_soon(self, future: concurrent.futures.Future[T]) -> bool:
        """Block for at most the allowance until `future` is done; whether it is."""
        if future.done():
            return True
        allowance = self.allowance()
        if allowance <= 0:
            return False
        began = self._clock()
        concurrent.futures.wait([future], timeout=allowance)
        self.spend(self._clock() - began)
        return future.done()
