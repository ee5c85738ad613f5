"""A block cache with least-recently-used eviction: the shared store, or one engine's own
prefix cache. Keys are chained block keys, so a hit on key i means the whole prefix up to
block i is held."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class BlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(0, capacity_blocks)
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def prefix_hits(self, keys: Sequence[int], limit: int, touch: bool = True) -> int:
        """How many leading blocks (at most `limit`) are held; a hit counts as a use."""
        hits = 0
        while hits < min(limit, len(keys)) and keys[hits] in self._blocks:
            if touch:
                self._blocks.move_to_end(keys[hits])
            hits += 1
        return hits

    def insert(self, keys: Sequence[int]) -> None:
        if self.capacity == 0:
            return
        for key in keys:
            if key in self._blocks:
                self._blocks.move_to_end(key)
            else:
                self._blocks[key] = None
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)
            self.evicted += 1
