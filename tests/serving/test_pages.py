"""Gather/scatter of whole pages: round trips over random block tables, layers and layouts."""

import ctypes

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvhelper.layout import describe_kv_caches
from kvhelper.pages import PageMover

from .conftest import gqa_spec, mla_spec, shared_caches

LAYOUTS = {
    "packed": ((12, 2, 16, 128), gqa_spec()),
    "kv_first": ((2, 12, 16, 2, 64), gqa_spec()),
    "block_kv": ((12, 2, 16, 2, 64), gqa_spec()),
    "mla": ((12, 16, 576), mla_spec()),
    "mla4d": ((12, 1, 16, 576), mla_spec()),
}


def block_view(cache: torch.Tensor, kind: str, block: int) -> torch.Tensor:
    """The logical content of one block, however the layout stores it."""
    return cache[:, block] if kind == "kv_first" else cache[block]


@settings(max_examples=60, deadline=None)
@given(kind=st.sampled_from(sorted(LAYOUTS)), layers=st.integers(1, 4),
       data=st.data())
def test_gather_then_scatter_elsewhere_moves_exactly_those_pages(kind, layers, data) -> None:
    shape, spec = LAYOUTS[kind]
    src = shared_caches(shape, layers, seed=1)
    dst = shared_caches(shape, layers, seed=2)
    before = {name: t.clone() for name, t in dst.items()}
    blocks = 12
    count = data.draw(st.integers(1, blocks))
    src_ids = data.draw(st.lists(st.integers(0, blocks - 1), min_size=count, max_size=count))
    dst_ids = data.draw(st.permutations(range(blocks)))[:count]

    src_mover = PageMover(describe_kv_caches(src, spec, num_blocks=blocks), src)
    dst_mover = PageMover(describe_kv_caches(dst, spec, num_blocks=blocks), dst)
    buffer = src_mover.gather(src_ids)
    assert buffer.numel() == src_mover.nbytes(count)
    dst_mover.scatter(dst_ids, buffer)

    for name in src:
        for s, d in zip(src_ids, dst_ids, strict=True):
            assert torch.equal(block_view(dst[name], kind, d), block_view(src[name], kind, s))
        untouched = sorted(set(range(blocks)) - set(dst_ids))
        for b in untouched:
            assert torch.equal(block_view(dst[name], kind, b), block_view(before[name], kind, b))


def test_gather_reuses_a_registered_buffer_and_copies_bytes_verbatim() -> None:
    caches = shared_caches((8, 64, 656), 2, dtype=torch.uint8)  # fp8_ds_mla pages
    layout = describe_kv_caches(caches, mla_spec(block=64, cache_dtype="fp8_ds_mla"))
    mover = PageMover(layout, caches)
    buffer = torch.empty(mover.nbytes(8), dtype=torch.uint8)
    pointer = buffer.data_ptr()
    out = mover.gather([5, 1], buffer)
    assert out.data_ptr() == pointer
    first_page = out[: layout.page_bytes].view(64, 656)
    assert torch.equal(first_page, caches["model.layers.0.attn"][5])


def test_separate_per_layer_tensors_use_the_per_layer_path() -> None:
    caches = {f"l{i}": torch.randn(6, 2, 16, 128).to(torch.bfloat16) for i in range(3)}
    layout = describe_kv_caches(caches, gqa_spec())
    assert layout.layer_stride is None
    mover = PageMover(layout, caches)
    buffer = mover.gather([4, 0])
    view = buffer.view(3, 2, -1)
    assert torch.equal(view[2, 0], caches["l2"][4].reshape(-1).view(torch.uint8))


def test_bad_requests_are_refused() -> None:
    caches = shared_caches((8, 16, 576), 1)
    mover = PageMover(describe_kv_caches(caches, mla_spec()), caches)
    with pytest.raises(IndexError, match=r"\[0, 8\)"):
        mover.gather([8])
    with pytest.raises(ValueError, match="distinct"):
        mover.scatter([1, 1], mover.gather([2, 3]))
    with pytest.raises(ValueError, match="holds 10 bytes"):
        mover.gather([1], torch.empty(10, dtype=torch.uint8))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sorted(LAYOUTS)), layers=st.integers(1, 3), data=st.data())
def test_block_major_buffers_hold_each_block_contiguously(kind, layers, data) -> None:
    shape, spec = LAYOUTS[kind]
    src = shared_caches(shape, layers, seed=3)
    mover = PageMover(describe_kv_caches(src, spec, num_blocks=12), src)
    ids = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    by_layer = mover.gather(ids).view(layers, len(ids), -1)
    by_block = mover.gather(ids, order="block").view(len(ids), layers, -1)
    assert torch.equal(by_block, by_layer.transpose(0, 1))
    dst = shared_caches(shape, layers, seed=4)
    dst_mover = PageMover(describe_kv_caches(dst, spec, num_blocks=12), dst)
    dst_mover.scatter(ids, by_block.reshape(-1), order="block")
    assert torch.equal(dst_mover.gather(ids), by_layer.reshape(-1))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(sorted(LAYOUTS)), layers=st.integers(1, 3), data=st.data())
def test_block_spans_address_exactly_the_bytes_of_a_block_major_value(kind, layers,
                                                                       data) -> None:
    shape, spec = LAYOUTS[kind]
    caches = shared_caches(shape, layers, seed=5)
    mover = PageMover(describe_kv_caches(caches, spec, num_blocks=12), caches)
    ids = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    start, size = mover.storage_span()
    storage = next(iter(caches.values())).untyped_storage()
    whole = torch.empty(0, dtype=torch.uint8)
    whole.set_(storage, 0, (storage.nbytes(),))
    origin = whole.data_ptr()
    assert origin <= start and start + size <= origin + storage.nbytes()
    spans = mover.block_spans(ids)
    read = torch.cat([whole[a - origin:a - origin + mover.row_bytes]
                      for block in spans for a in block])
    assert torch.equal(read, mover.gather(ids, order="block"))


@settings(max_examples=30, deadline=None)
@given(layers=st.integers(1, 3), data=st.data())
def test_head_spans_in_the_cache_and_in_a_gathered_buffer_hold_the_same_bytes(layers,
                                                                              data) -> None:
    """A shard of heads (what a rank holding several store shards moves): read from the cache
    directly, or from a staging buffer `gather` filled, the pieces are that head's bytes."""
    caches = shared_caches((12, 4, 16, 32), layers, seed=6)  # packed: 4 heads of 16
    mover = PageMover(describe_kv_caches(caches, gqa_spec(heads=4, head_dim=16), num_blocks=12),
                      caches)
    ids = data.draw(st.lists(st.integers(0, 11), min_size=1, max_size=6, unique=True))
    heads = data.draw(st.sampled_from([(0, 1), (1, 1), (2, 2), (0, 4)]))
    buffer = mover.gather(ids, order="block")
    size = mover.piece_bytes(heads)
    assert size == heads[1] * 16 * 32 * 2

    def read(spans: list[list[int]]) -> bytes:
        return b"".join(ctypes.string_at(a, size) for block in spans for a in block)

    from_cache = read(mover.block_spans(ids, heads))
    assert from_cache == read(mover.buffer_spans(buffer.data_ptr(), len(ids), heads))
    expected = torch.stack([cache[ids, heads[0]:heads[0] + heads[1]]
                            for cache in caches.values()], dim=1)  # (blocks, layers, ...)
    assert from_cache == expected.contiguous().view(torch.uint8).numpy().tobytes()
