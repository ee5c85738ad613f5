"""Ground truth from vLLM itself: caches written by vLLM's CPU cache-update code and read back by
vLLM's CPU attention kernels. Pages moved by kvhelper to other block ids must make the kernels
produce bit-identical outputs; a corrupted page must not."""

import torch
from kvhelper.layout import describe_kv_caches
from kvhelper.pages import PageMover
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

from .conftest import gqa_spec, mla_spec

DTYPE = torch.bfloat16
BLOCK, BLOCKS, TOKENS, LAYERS = 16, 12, 40, 2  # 40 tokens: 2 full blocks and a partial one
KV_HEADS, Q_HEADS, HEAD_DIM = 2, 4, 64
SRC_BLOCKS, DST_BLOCKS = [3, 5, 7], [10, 2, 8]


def slots_for(blocks: list[int]) -> torch.Tensor:
    positions = torch.arange(TOKENS)
    return (torch.tensor(blocks)[positions // BLOCK] * BLOCK + positions % BLOCK).long()


def gqa_attend(cache: torch.Tensor, table: list[int], query: torch.Tensor) -> torch.Tensor:
    isa = _get_attn_isa(DTYPE, BLOCK, HEAD_DIM)
    key_cache, value_cache = cache.view(BLOCKS, KV_HEADS, BLOCK * 2, HEAD_DIM).chunk(2, dim=2)
    out = torch.zeros(1, Q_HEADS, HEAD_DIM, dtype=DTYPE)
    starts = torch.tensor([0, 1], dtype=torch.int32)
    lens = torch.tensor([TOKENS], dtype=torch.int32)
    meta = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=lens,
        dtype=DTYPE, query_start_loc=starts, causal=True, sliding_window_size=-1, isa=isa,
        enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=out,
        query_start_loc=starts, seq_lens=lens, scale=0.125, causal=True, alibi_slopes=None,
        sliding_window=-1, block_table=torch.tensor([table], dtype=torch.int32), softcap=0.0,
        scheduler_metadata=meta, s_aux=None)
    return out


def gqa_caches(seed: int, write: bool) -> dict[str, torch.Tensor]:
    storage = torch.zeros(LAYERS * BLOCKS * KV_HEADS * BLOCK * 2 * HEAD_DIM, dtype=DTYPE)
    caches = {f"layers.{i}": chunk.view(BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM)
              for i, chunk in enumerate(storage.chunk(LAYERS))}
    if write:
        generator = torch.Generator().manual_seed(seed)
        isa = _get_attn_isa(DTYPE, BLOCK, HEAD_DIM)
        for cache in caches.values():
            key = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator).to(DTYPE)
            value = torch.randn(TOKENS, KV_HEADS, HEAD_DIM, generator=generator).to(DTYPE)
            key_cache, value_cache = cache.view(
                BLOCKS, KV_HEADS, BLOCK * 2, HEAD_DIM).chunk(2, dim=2)
            ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                           slots_for(SRC_BLOCKS), isa)
    return caches


def test_gqa_pages_moved_to_other_blocks_attend_identically() -> None:
    src, dst = gqa_caches(0, write=True), gqa_caches(0, write=False)
    spec = gqa_spec(heads=KV_HEADS, head_dim=HEAD_DIM, block=BLOCK)
    src_mover = PageMover(describe_kv_caches(src, spec), src)
    dst_mover = PageMover(describe_kv_caches(dst, spec), dst)
    buffer = src_mover.gather(SRC_BLOCKS)
    dst_mover.scatter(DST_BLOCKS, buffer)
    query = torch.randn(1, Q_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(9))
    query = query.to(DTYPE)
    for name in src:
        expected = gqa_attend(src[name], SRC_BLOCKS, query)
        assert torch.equal(gqa_attend(dst[name], DST_BLOCKS, query), expected), name

    # Negative control: one flipped byte in one page must change what vLLM computes.
    corrupted = buffer.clone()
    corrupted[100] ^= 0x40
    dst_mover.scatter(DST_BLOCKS, corrupted)
    name = next(iter(src))
    assert not torch.equal(gqa_attend(dst[name], DST_BLOCKS, query),
                           gqa_attend(src[name], SRC_BLOCKS, query))


def mla_caches(write: bool) -> dict[str, torch.Tensor]:
    storage = torch.zeros(LAYERS * BLOCKS * BLOCK * 576, dtype=DTYPE)
    caches = {f"layers.{i}": chunk.view(BLOCKS, BLOCK, 576)
              for i, chunk in enumerate(storage.chunk(LAYERS))}
    if write:
        generator = torch.Generator().manual_seed(3)
        for cache in caches.values():
            latent = torch.randn(TOKENS, 512, generator=generator).to(DTYPE)
            rope = torch.randn(TOKENS, 1, 64, generator=generator).to(DTYPE)
            # vLLM's own CPU MLA cache write (it does not use `self`).
            CPUMLAImpl.do_kv_cache_update(None, latent, rope, cache,  # type: ignore[arg-type]
                                          slots_for(SRC_BLOCKS), "auto", None)
    return caches


def mla_attend(cache: torch.Tensor, table: list[int]) -> torch.Tensor:
    query = torch.randn(1, Q_HEADS, 576, generator=torch.Generator().manual_seed(1)).to(DTYPE)
    out = torch.zeros(1, Q_HEADS, 512, dtype=DTYPE)
    ops.mla_decode_kvcache_cpu(out, query, cache, 0.1, torch.tensor([table], dtype=torch.int32),
                               torch.tensor([TOKENS], dtype=torch.int32))
    return out


def test_mla_pages_moved_to_other_blocks_attend_identically() -> None:
    src, dst = mla_caches(write=True), mla_caches(write=False)
    src_layout = describe_kv_caches(src, mla_spec())
    src_mover = PageMover(src_layout, src)
    dst_mover = PageMover(describe_kv_caches(dst, mla_spec()), dst)
    buffer = src_mover.gather(SRC_BLOCKS)
    assert buffer.numel() == LAYERS * 3 * BLOCK * 576 * 2  # one latent per token, not K and V
    dst_mover.scatter(DST_BLOCKS, buffer)
    for name in src:
        assert torch.equal(mla_attend(dst[name], DST_BLOCKS), mla_attend(src[name], SRC_BLOCKS))

    # Negative control: reading the right pages through a block table that is off by one.
    name = next(iter(src))
    assert not torch.equal(mla_attend(dst[name], [10, 2, 9]), mla_attend(src[name], SRC_BLOCKS))
