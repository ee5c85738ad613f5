"""K/V pages in head shards: instances of different TP sizes exchange them when they use the
same shard count (store_tp_size); every other combination is refused with a message."""

from __future__ import annotations

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvhelper.compat import differences
from kvhelper.layout import LayoutError, describe_kv_caches
from kvhelper.pages import PageMover
from kvhelper.tp import StoreSharding, TPMismatchError, heads_of_rank, store_sharding

from .conftest import gqa_spec, shared_caches

BLOCK, HEAD_DIM, LAYERS, BLOCKS = 4, 8, 3, 5


def test_vllm_head_assignment() -> None:
    assert [heads_of_rank(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4),
                                                          range(4, 6), range(6, 8)]
    # Fewer heads than ranks: replicated, ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(TPMismatchError, match="do not split"):
        heads_of_rank(6, 4, 0)


def test_by_default_a_rank_stores_its_page_as_one_shard() -> None:
    assert store_sharding(8, 2, 1) == StoreSharding(shards=2, heads_per_shard=4, first_shard=1,
                                                    local_shards=1, writes=True)
    # More ranks than heads: one shard per head, stored by the first of its replicas.
    assert [store_sharding(2, 4, r) for r in range(4)] == [
        StoreSharding(2, 1, head, 1, writes=r % 2 == 0) for r, head in enumerate([0, 0, 1, 1])]


def test_a_rank_splits_its_page_into_several_shards() -> None:
    sharding = store_sharding(8, 2, 1, requested=4)
    assert (list(sharding.shard_ids), sharding.heads_per_shard) == ([2, 3], 2)
    assert [sharding.head_offset(i) for i in range(2)] == [0, 2]
    assert store_sharding(2, 4, 3, requested=8).shards == 2  # capped at the heads


@pytest.mark.parametrize(("heads", "tp", "requested", "message"), [
    (8, 2, 3, "store_tp_size 3 does not divide the model's 8 KV heads"),
    (8, 4, 2, "each rank of TP 4 holds 2: a shard would span ranks; use a multiple of 4"),
    (8, 2, 0, "store_tp_size must be a positive integer, not 0"),
    (8, 2, "4", "store_tp_size must be a positive integer, not '4'"),
])
def test_unusable_shard_counts_are_refused(heads, tp, requested, message) -> None:
    with pytest.raises(TPMismatchError, match=message):
        store_sharding(heads, tp, 0, requested)


def test_a_shard_count_mismatch_says_what_to_set() -> None:
    found = differences({"store_tp_size": 2}, {"store_tp_size": 1})
    assert found[0] == "store_tp_size: 2 (prefill) != 1 (decode)"
    assert "set kv_connector_extra_config.store_tp_size" in found[1]


def test_splitting_pages_by_head_needs_a_head_major_layout() -> None:
    caches = shared_caches((4, 2, 16, 2, 64), 1)  # (2, B, N, H, D): heads interleaved
    mover = PageMover(describe_kv_caches(caches, gqa_spec(), num_blocks=4), caches)
    assert mover.piece_bytes() == mover.row_bytes  # whole pages still move
    with pytest.raises(LayoutError, match="cannot be split by head"):
        mover.block_spans([0], heads=(0, 1))


def rank_cache(total: int, tp: int, rank: int) -> tuple[PageMover, torch.Tensor]:
    """A packed (head-major) CPU cache of one rank whose every byte says (block, global head)."""
    spec = gqa_spec(heads=total, head_dim=HEAD_DIM, block=BLOCK, tp=tp, rank=rank)
    heads = spec.kv_heads_per_rank
    storage = torch.zeros(LAYERS, BLOCKS, heads, BLOCK, 2 * HEAD_DIM, dtype=torch.uint8)
    caches = {f"l{i}": storage[i] for i in range(LAYERS)}
    return PageMover(describe_kv_caches(caches, spec), caches), storage


def expected(total: int, tp: int, rank: int) -> torch.Tensor:
    owned = heads_of_rank(total, tp, rank)
    page = torch.empty(LAYERS, BLOCKS, len(owned), BLOCK, 2 * HEAD_DIM, dtype=torch.uint8)
    for block in range(BLOCKS):
        for index, head in enumerate(owned):
            page[:, block, index] = 16 * block + head
    return page


def shard_pieces(mover: PageMover, sharding: StoreSharding
                 ) -> tuple[int, dict[int, list[list[int]]]]:
    """Piece size, and for each of a rank's shards each block's piece addresses in its cache
    (whole pages when the rank holds one shard, as the connector does)."""
    heads = sharding.piece_heads()
    return mover.piece_bytes(heads[0]), {shard: mover.block_spans(list(range(BLOCKS)), heads[j])
                                         for j, shard in enumerate(sharding.shard_ids)}


@settings(max_examples=120, deadline=None)
@given(total=st.sampled_from([1, 2, 4, 8]), src_tp=st.sampled_from([1, 2, 4, 8]),
       dst_tp=st.sampled_from([1, 2, 4, 8]), requested=st.sampled_from([None, 1, 2, 4, 8]))
def test_decode_ranks_get_exactly_their_heads_from_any_prefill_tp(
        total, src_tp, dst_tp, requested) -> None:
    """Prefill ranks write their shards (as the connector does, from cache addresses); decode
    ranks read them into their caches. Wherever both sides accept the shard count, every
    decode rank ends up with exactly its heads, and each shard is written once."""
    try:
        src = [store_sharding(total, src_tp, r, requested) for r in range(src_tp)]
        dst = [store_sharding(total, dst_tp, r, requested) for r in range(dst_tp)]
    except TPMismatchError:
        return  # refused at start-up, before any transfer
    if src[0].shards != dst[0].shards:
        return  # refused by decode, naming store_tp_size (compat.differences)
    store: dict[tuple[int, int], bytes] = {}  # (block, shard) -> value
    for rank, sharding in enumerate(src):
        mover, storage = rank_cache(total, src_tp, rank)
        storage.copy_(expected(total, src_tp, rank))
        if not sharding.writes:
            continue
        size, shards = shard_pieces(mover, sharding)
        for shard, blocks in shards.items():
            for block, pieces in enumerate(blocks):
                assert (block, shard) not in store
                store[block, shard] = b"".join(ctypes.string_at(a, size) for a in pieces)
    assert sorted(store) == [(b, s) for b in range(BLOCKS) for s in range(src[0].shards)]
    for rank, sharding in enumerate(dst):
        mover, storage = rank_cache(total, dst_tp, rank)
        size, shards = shard_pieces(mover, sharding)
        for shard, blocks in shards.items():
            for block, pieces in enumerate(blocks):
                value = store[block, shard]
                assert len(value) == size * len(pieces)
                for i, address in enumerate(pieces):
                    ctypes.memmove(address, value[i * size:(i + 1) * size], size)
        assert torch.equal(storage, expected(total, dst_tp, rank))
