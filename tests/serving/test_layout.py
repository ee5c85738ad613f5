"""Layout detection for every cache shape vLLM backends register, and clear refusals."""

import pytest
import torch
from kvhelper.layout import LayoutError, LayoutKind, describe_kv_caches

from .conftest import gqa_spec, mla_spec, shared_caches


@pytest.mark.parametrize(("shape", "kind", "page_bytes", "regions"), [
    ((10, 2, 16, 128), LayoutKind.PACKED, 2 * 16 * 128 * 2, 1),  # CPU / GPU packed
    ((2, 10, 16, 2, 64), LayoutKind.KV_FIRST, 2 * 16 * 2 * 64 * 2, 2),  # legacy FlashAttention
    ((10, 2, 16, 2, 64), LayoutKind.BLOCK_KV, 2 * 16 * 2 * 64 * 2, 1),  # FlashInfer
])
def test_gqa_layouts(shape, kind, page_bytes, regions) -> None:
    layout = describe_kv_caches(shared_caches(shape, 3), gqa_spec(), num_blocks=10)
    assert (layout.kind, layout.num_blocks, layout.page_bytes) == (kind, 10, page_bytes)
    assert len(layout.regions) == regions
    assert layout.kv_heads == 2 and not layout.rank_agnostic
    assert layout.layer_stride == 10 * page_bytes  # one storage, layer-major


@pytest.mark.parametrize("shape", [(10, 1, 16, 576), (10, 16, 576)])
def test_mla_layouts(shape) -> None:
    layout = describe_kv_caches(shared_caches(shape, 2), mla_spec())
    assert layout.kind is LayoutKind.MLA and layout.rank_agnostic
    assert layout.page_bytes == 16 * 576 * 2  # one latent, never K and V
    assert layout.kv_heads == 1


def test_fp8_ds_mla_pages_are_bytes() -> None:
    caches = shared_caches((10, 64, 656), 2, dtype=torch.uint8)
    layout = describe_kv_caches(caches, mla_spec(block=64, cache_dtype="fp8_ds_mla"))
    assert layout.page_bytes == 64 * 656 and layout.dtype == torch.uint8


def test_packed_head_major_with_strides_permuted_inside_a_block() -> None:
    # Same logical shape, heads not outermost physically: pages still move whole,
    # but a page cannot be split by head.
    base = torch.zeros(10, 16, 2, 128, dtype=torch.bfloat16)
    cache = base.permute(0, 2, 1, 3)  # logical (B, H, N, 2D), physical (B, N, H, 2D)
    layout = describe_kv_caches({"l0": cache}, gqa_spec())
    assert layout.kind is LayoutKind.PACKED and not layout.head_major
    assert layout.page_bytes == 2 * 16 * 128 * 2


def test_unknown_layout_says_what_was_seen() -> None:
    with pytest.raises(LayoutError, match=r"shape \[10, 16, 3, 64\].*expected \(blocks, 2, 16"):
        describe_kv_caches({"l0": torch.zeros(10, 16, 3, 64)}, gqa_spec())
    with pytest.raises(LayoutError, match="MLA cache not understood.*576"):
        describe_kv_caches({"l0": torch.zeros(10, 16, 512)}, mla_spec())


def test_mixed_layer_shapes_are_refused() -> None:
    caches = {"a": torch.zeros(10, 2, 16, 128), "b": torch.zeros(11, 2, 16, 128)}
    with pytest.raises(LayoutError, match="layer b has shape"):
        describe_kv_caches(caches, gqa_spec())


def test_ambiguous_five_dim_needs_num_blocks() -> None:
    caches = shared_caches((2, 2, 16, 2, 64), 1)
    with pytest.raises(LayoutError, match="ambiguous"):
        describe_kv_caches(caches, gqa_spec())


def test_fingerprint_tracks_what_must_match() -> None:
    base = describe_kv_caches(shared_caches((10, 16, 576), 2), mla_spec())
    same = describe_kv_caches(shared_caches((99, 16, 576), 4), mla_spec())
    assert base.fingerprint() == same.fingerprint()  # block count and layer count don't matter
    other_dtype = describe_kv_caches(shared_caches((10, 16, 576), 2, dtype=torch.float16),
                                     mla_spec(cache_dtype="float16"))
    assert other_dtype.fingerprint() != base.fingerprint()
    gqa_tp1 = describe_kv_caches(shared_caches((10, 4, 16, 128), 2), gqa_spec(heads=4))
    gqa_tp2 = describe_kv_caches(shared_caches((10, 2, 16, 128), 2), gqa_spec(heads=4, tp=2))
    assert gqa_tp1.fingerprint() == gqa_tp2.fingerprint()  # TP is mapped, not fingerprinted
    assert len(base.fingerprint()) == 16
