"""Moving a request's block values between the KV cache and the Mooncake store.

One store value per block, or per block and head shard (`kvhelper.tp`): the pages of that block
in every layer. Keys come block-major, each block's shards in order (`value_keys`). Two ways:

- `DirectBlockIO` (host caches: vLLM's CPU build): Mooncake reads and writes each value straight
  from the cache, one piece per layer (and region) of the block. The whole cache is registered.
- `StagedBlockIO` (device caches, or on request): pages are gathered into a registered host
  buffer of bounded size and stored from there, chunk by chunk; loads go the other way. A device
  cache is gathered on the device first and copied to the host, since a gather cannot write
  across devices.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import torch

from kvhelper.keys import block_key
from kvhelper.pages import PageMover
from kvhelper.store import MooncakeKVStore, PutResult
from kvhelper.tp import StoreSharding

Heads = tuple[int, int] | None  # (first, count) of a rank's heads; None: the whole page
Spans = tuple[list[list[int]], int]  # each key's piece addresses, and the bytes of every piece
LoadJob = Callable[[], dict[str, int]]  # runs a load; returns the keys that failed, with codes
DEFAULT_STAGING_BYTES = 256 << 20
# Device memory for gathers: small, since vLLM has given the device's spare memory to the cache.
DEVICE_BUFFER_BYTES = 32 << 20


def value_keys(fingerprint: str, hashes: Sequence[str], sharding: StoreSharding | None
               ) -> list[str]:
    """The store keys of blocks' values, in the order every method here takes them:
    block-major, each block's shards in order (`sharding` None: one rank-agnostic value)."""
    if sharding is None:
        return [block_key(fingerprint, h) for h in hashes]
    return [block_key(fingerprint, h, (sharding.shards, shard))
            for h in hashes for shard in sharding.shard_ids]


def block_value_keys(fingerprint: str, hashes: Sequence[str], shards: int | None
                     ) -> list[list[str]]:
    """Per block, the keys of every value an instance of this layout needs to load it: the
    one rank-agnostic value (`shards` None), or every head shard."""
    if shards is None:
        return [[block_key(fingerprint, h)] for h in hashes]
    return [[block_key(fingerprint, h, (shards, shard)) for shard in range(shards)]
            for h in hashes]


class _BlockIO:
    def __init__(self, store: MooncakeKVStore, mover: PageMover,
                 shard_heads: Sequence[Heads]) -> None:
        self._store, self._mover, self._shard_heads = store, mover, list(shard_heads)
        layout = mover.layout
        self._block_bytes = layout.page_bytes * layout.num_layers  # all of a block's shards

    @property
    def values_per_block(self) -> int:
        """Store values per block on this rank: one, or one per head shard it holds."""
        return len(self._shard_heads)

    @property
    def value_bytes(self) -> int:
        """Bytes of one store value: a block's pages (of one shard) in every layer."""
        return self._block_bytes // self.values_per_block


class DirectBlockIO(_BlockIO):
    """Values straight between a host cache and the store; no copy of our own."""

    def __init__(self, store: MooncakeKVStore, mover: PageMover,
                 shard_heads: Sequence[Heads]) -> None:
        if mover.device.type != "cpu":
            raise ValueError(f"direct transfers need the KV cache in host memory, not on "
                             f"{mover.device}; use transfer: staging")
        super().__init__(store, mover, shard_heads)
        store.register_range(*mover.storage_span())

    def describe(self) -> str:
        return "direct cache transfers"

    def close(self) -> None:
        self._store.unregister_range(self._mover.storage_span()[0])

    def _batch(self, keys: list[str], block_ids: list[int]) -> tuple[list[str], Spans]:
        """The keys and their pieces, in the order of the blocks' place in the cache: Mooncake
        copies pieces in batch order, and walking the cache forwards rather than in the
        request's (scattered) block order measured about 10% faster on MLA's small pages."""
        per_block = self.values_per_block
        order = sorted(range(len(block_ids)), key=block_ids.__getitem__)
        ordered_ids = [block_ids[b] for b in order]
        per_shard = [self._mover.block_spans(ordered_ids, heads) for heads in self._shard_heads]
        ordered_keys = [keys[b * per_block + j] for b in order for j in range(per_block)]
        return ordered_keys, (_interleave(per_shard),
                              self._mover.piece_bytes(self._shard_heads[0]))

    def store(self, keys: list[str], block_ids: list[int]) -> PutResult:
        ordered_keys, spans = self._batch(keys, block_ids)
        return self._store.put_parts(ordered_keys, *spans)

    def load_job(self, keys: list[str], block_ids: list[int]) -> LoadJob:
        # Addresses now, on the caller's thread: the job may run on a loader thread that should
        # need the GIL as little as possible (vLLM's busy loop holds it).
        ordered_keys, spans = self._batch(keys, block_ids)
        return lambda: self._store.get_parts(ordered_keys, *spans)


class StagedBlockIO(_BlockIO):
    """Values through a registered host buffer, `buffer_bytes` at most, chunk by chunk; a
    device cache's pages pass through a device buffer of `device_buffer_bytes` on the way."""

    def __init__(self, store: MooncakeKVStore, mover: PageMover, shard_heads: Sequence[Heads],
                 buffer_bytes: int, device_buffer_bytes: int | None = None) -> None:
        super().__init__(store, mover, shard_heads)
        self._chunk_blocks = buffer_bytes // self._block_bytes
        if self._chunk_blocks < 1:
            raise ValueError(f"staging_buffer_bytes {buffer_bytes} is less than one block's "
                             f"pages ({self._block_bytes} bytes)")
        on_device = mover.device.type != "cpu"
        self._host = torch.empty(self._chunk_blocks * self._block_bytes, dtype=torch.uint8,
                                 pin_memory=mover.device.type == "cuda")
        store.register(self._host)
        if device_buffer_bytes is None and on_device:
            device_buffer_bytes = DEVICE_BUFFER_BYTES
        self._device_buffer: torch.Tensor | None = None
        self._device_blocks = 0
        if device_buffer_bytes is not None:  # (given on a host cache: tests of this path)
            self._device_blocks = max(1, min(self._chunk_blocks,
                                             device_buffer_bytes // self._block_bytes))
            self._device_buffer = torch.empty(self._device_blocks * self._block_bytes,
                                              dtype=torch.uint8, device=mover.device)
        # Stores (the step's thread) and loads (the loader thread) share the buffer.
        self._lock = threading.Lock()

    def describe(self) -> str:
        return (f"transfers through a {self._host.numel() >> 20} MiB staging buffer "
                f"({self._chunk_blocks} blocks at a time)")

    def close(self) -> None:
        with self._lock:
            self._store.unregister(self._host)

    def _chunks(self, keys: list[str], block_ids: list[int]
                ) -> Iterator[tuple[list[str], list[int]]]:
        per_block = self.values_per_block
        for start in range(0, len(block_ids), self._chunk_blocks):
            ids = block_ids[start:start + self._chunk_blocks]
            yield keys[start * per_block:(start + len(ids)) * per_block], ids

    def _spans(self, count: int) -> Spans:
        """Where gather(order="block") puts `count` blocks' values in the host buffer."""
        base = self._host.data_ptr()
        if len(self._shard_heads) == 1 and self._shard_heads[0] is None:
            return [[base + i * self._block_bytes] for i in range(count)], self._block_bytes
        per_shard = [self._mover.buffer_spans(base, count, heads) for heads in self._shard_heads]
        return _interleave(per_shard), self._mover.piece_bytes(self._shard_heads[0])

    def _through_device(self, block_ids: list[int]) -> Iterator[tuple[list[int], slice]]:
        """Runs of blocks that fit the device buffer, with their place in the host buffer."""
        for start in range(0, len(block_ids), self._device_blocks):
            ids = block_ids[start:start + self._device_blocks]
            yield ids, slice(start * self._block_bytes, (start + len(ids)) * self._block_bytes)

    def _stage_out(self, block_ids: list[int]) -> None:
        device = self._device_buffer
        if device is None:
            self._mover.gather(block_ids, self._host, order="block")
            return
        for ids, place in self._through_device(block_ids):
            self._mover.gather(ids, device, order="block")
            self._host[place].copy_(device[:place.stop - place.start])

    def _stage_in(self, block_ids: list[int]) -> None:
        device = self._device_buffer
        if device is None:
            self._mover.scatter(block_ids, self._host, order="block")
            return
        for ids, place in self._through_device(block_ids):
            device[:place.stop - place.start].copy_(self._host[place])
            self._mover.scatter(ids, device, order="block")

    def store(self, keys: list[str], block_ids: list[int]) -> PutResult:
        """Store the values the store lacks; blocks whose every value it has are not even
        gathered (a shared prefix costs one existence check)."""
        per_block = self.values_per_block
        present = self._store.exists(keys)
        result = PutResult(skipped=[key for key, there in zip(keys, present, strict=True)
                                    if there])
        todo = [b for b in range(len(block_ids))  # positions of blocks with a value missing
                if not all(present[b * per_block:(b + 1) * per_block])]
        with self._lock:
            for start in range(0, len(todo), self._chunk_blocks):
                chunk = todo[start:start + self._chunk_blocks]
                self._stage_out([block_ids[b] for b in chunk])
                spans, piece_bytes = self._spans(len(chunk))
                wanted = [(keys[b * per_block + j], spans[i * per_block + j])
                          for i, b in enumerate(chunk) for j in range(per_block)
                          if not present[b * per_block + j]]
                part = self._store.put_parts([key for key, _ in wanted],
                                             [pieces for _, pieces in wanted], piece_bytes,
                                             skip_existing=False)
                result.stored += part.stored
                result.failed.update(part.failed)
        return result

    def load_job(self, keys: list[str], block_ids: list[int]) -> LoadJob:
        def run() -> dict[str, int]:
            per_block = self.values_per_block
            with self._lock:
                for chunk_keys, chunk_ids in self._chunks(keys, block_ids):
                    failed = self._store.get_parts(chunk_keys, *self._spans(len(chunk_ids)))
                    first = next((i for i, key in enumerate(chunk_keys) if key in failed),
                                 len(chunk_keys))
                    if first >= per_block:  # whole blocks arrived before any failure
                        self._stage_in(chunk_ids[:first // per_block])
                    if failed:  # a prefix must be contiguous: the rest is useless
                        return failed
            return {}

        return run


def _interleave(per_shard: list[list[list[int]]]) -> list[list[int]]:
    """[shard][block] -> block-major: each block's shards in order."""
    return [spans for block in zip(*per_shard, strict=True) for spans in block]
