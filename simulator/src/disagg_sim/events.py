"""The event loop: a clock and a heap of timed callbacks.

A hand-written heap rather than SimPy: engines here advance analytically between events (a
decode batch's steps are summed in closed form), so there are a few events per request rather
than one per decode step, and SimPy's process model would add nothing but overhead.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._order = itertools.count()

    def at(self, time: float, action: Callable[[], None]) -> None:
        """Run `action` at `time` (never before now); ties run in the order scheduled."""
        heapq.heappush(self._heap, (max(time, self.now), next(self._order), action))

    def run(self, until: float = float("inf")) -> None:
        while self._heap and self._heap[0][0] <= until:
            self.now, _, action = heapq.heappop(self._heap)
            action()
        self.now = max(self.now, min(until, self.now if not self._heap else until))
