"""Block values between a KV cache and a real Mooncake store, directly and through a staging
buffer chunk by chunk: the same values either way, and a missing value stops a load there."""

from __future__ import annotations

import pytest
import torch
from kvhelper.block_io import DirectBlockIO, StagedBlockIO
from kvhelper.layout import describe_kv_caches
from kvhelper.pages import PageMover
from kvhelper.store import MooncakeKVStore

from .conftest import gqa_spec, shared_caches

SHAPE = (12, 4, 16, 32)  # packed K/V cache: 12 blocks, 4 heads, 16 tokens, K and V of 16
LAYERS = 2
BLOCK_BYTES = LAYERS * 4 * 16 * 32 * 2


def mover(seed: int) -> PageMover:
    caches = shared_caches(SHAPE, LAYERS, seed=seed)
    return PageMover(describe_kv_caches(caches, gqa_spec(heads=4, head_dim=16), num_blocks=12),
                     caches)


def block(m: PageMover, block_id: int) -> list[torch.Tensor]:
    layout = m.layout
    return [m.gather([block_id]).view(layout.num_layers, -1)[i] for i in range(LAYERS)]


@pytest.mark.parametrize("shards", [[None], [(0, 2), (2, 2)]])
@pytest.mark.parametrize("device_buffer", [None, BLOCK_BYTES])
def test_staged_and_direct_paths_store_the_same_values(store: MooncakeKVStore, shards,
                                                         device_buffer) -> None:
    """`device_buffer`: pages pass through a second buffer one block at a time, as a device
    cache's do (here on the CPU)."""
    ids = [7, 2, 9, 4, 11]
    keys = [f"k{i}/{j}" for i in range(len(ids)) for j in range(len(shards))]
    source = mover(seed=1)
    staged = StagedBlockIO(store, source, shards, buffer_bytes=2 * BLOCK_BYTES + 100,
                           device_buffer_bytes=device_buffer)
    assert "2 blocks at a time" in staged.describe()
    result = staged.store(keys, ids)  # three chunks
    assert result.stored == keys and not result.failed
    assert staged.store(keys, ids).skipped == keys
    target = mover(seed=2)
    direct = DirectBlockIO(store, target, shards)
    assert direct.load_job(keys, [0, 1, 3, 5, 6])() == {}
    for src, dst in zip(ids, [0, 1, 3, 5, 6], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(block(source, src), block(target, dst),
                                                     strict=True))
    direct_keys = [f"d/{key}" for key in keys]
    assert direct.store(direct_keys, [0, 1, 3, 5, 6]).stored == direct_keys
    for key, direct_key in zip(keys, direct_keys, strict=True):
        assert store.size(key) == store.size(direct_key) == BLOCK_BYTES // len(shards)


def test_a_staged_load_stops_at_the_first_missing_value(store: MooncakeKVStore) -> None:
    source, target = mover(seed=3), mover(seed=4)
    keys = [f"m{i}" for i in range(5)]
    staged_out = StagedBlockIO(store, source, [None], buffer_bytes=2 * BLOCK_BYTES)
    staged_out.store(keys, [0, 1, 2, 3, 4])
    store.remove(keys[3], force=True)  # in the second chunk
    untouched = block(target, 8)
    staged_in = StagedBlockIO(store, target, [None], buffer_bytes=2 * BLOCK_BYTES,
                              device_buffer_bytes=BLOCK_BYTES)
    failed = staged_in.load_job(keys, [5, 6, 7, 8, 9])()
    assert list(failed) == [keys[3]]
    for src, dst in ((0, 5), (1, 6), (2, 7)):  # the blocks before it are in place
        assert all(torch.equal(a, b) for a, b in zip(block(source, src), block(target, dst),
                                                     strict=True))
    # Block 3's chunk partner (block 2, id 7) arrived; block 8 after the gap was not written.
    assert all(torch.equal(a, b) for a, b in zip(block(target, 8), untouched, strict=True))


def test_a_staging_buffer_smaller_than_a_block_is_refused(store: MooncakeKVStore) -> None:
    with pytest.raises(ValueError, match="staging_buffer_bytes 100 is less than one block"):
        StagedBlockIO(store, mover(seed=5), [None], buffer_bytes=100)


def test_a_staged_store_writes_only_the_values_the_store_lacks(store: MooncakeKVStore) -> None:
    source, target = mover(seed=7), mover(seed=8)
    keys = [f"p{i}/{j}" for i in range(4) for j in range(2)]
    staged = StagedBlockIO(store, source, [(0, 2), (2, 2)], buffer_bytes=BLOCK_BYTES)
    assert staged.store(keys[2:4], [5]).stored == keys[2:4]  # block 5's two shards
    store.remove(keys[3], force=True)  # one of them is gone again
    result = staged.store(keys, [4, 5, 6, 7])
    assert result.skipped == [keys[2]]
    assert result.stored == [key for key in keys if key != keys[2]] and not result.failed
    assert DirectBlockIO(store, target, [(0, 2), (2, 2)]).load_job(keys, [0, 1, 2, 3])() == {}
    for src, dst in zip([4, 5, 6, 7], [0, 1, 2, 3], strict=True):
        assert all(torch.equal(a, b) for a, b in zip(block(source, src), block(target, dst),
                                                     strict=True))
