"""What each prefill instance's own prefix cache probably holds: the block hashes of the prompts
the proxy sent it, most recent last, up to a bound (vLLM evicts its free blocks least recently
used first, so the oldest go first here too).

Store-aware routing weighs it when it picks a prefill instance: a block the instance still
holds costs nothing there, while another instance must load it from the store. The guess can
be wrong either way (the engine evicted sooner, or another proxy sent the prompt); a wrong
guess costs only a load or a missed reuse, never a wrong token: the instance's connector
loads from the store whatever its own cache lacks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# About a small GPU's KV cache in blocks; an instance with less evicts sooner than this guess.
HELD_BLOCKS = 16_384


class HeldPrefixes:
    def __init__(self, capacity_blocks: int = HELD_BLOCKS) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[str, None] = OrderedDict()

    def leading(self, hashes: Sequence[str]) -> int:
        """How many of `hashes`, from the first, are held."""
        count = 0
        for block in hashes:
            if block not in self._blocks:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[str]) -> None:
        """The instance now holds `hashes` (it computed or loaded them), the newest uses; the
        first block last, as vLLM frees a finished request's blocks from the last one, so that
        its tail is evicted before the prefix that other prompts share."""
        for block in reversed(hashes):
            self._blocks[block] = None
            self._blocks.move_to_end(block)
        while len(self._blocks) > self.capacity_blocks:
            self._blocks.popitem(last=False)
