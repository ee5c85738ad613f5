"""What a KV cache looks like in memory, detected from the tensors vLLM registers.

A *page* is one block of one layer: the unit the connector moves whole (never token by token,
never re-quantized). The layout says where each page's bytes live, so that any backend's cache
can be gathered into a transfer buffer and scattered back. Detection uses the tensors' shapes,
strides and dtype plus the model config, never an attention backend's name.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from kvhelper import FORMAT_VERSION

# DeepSeek-V3.2's fp8_ds_mla row: 512 fp8 latent + 4 fp32 scales + 64 bf16 rope = 656 bytes.
FP8_DS_MLA_ROW_BYTES = 656


class LayoutError(ValueError):
    """A KV cache this helper cannot describe; the message says what was seen and expected."""


class LayoutKind(enum.StrEnum):
    MLA = "mla"  # (B, N, L) or (B, 1, N, L): one latent row per token, no heads
    PACKED = "packed"  # (B, H, N, 2*D): K and V of each head packed per block (CPU, GPU)
    KV_FIRST = "kv_first"  # (2, B, N, H, D): K and V halves in separate tensors (legacy FA)
    BLOCK_KV = "block_kv"  # (B, 2, N, H, D): K then V inside each block (FlashInfer)


@dataclass(frozen=True)
class ModelKVSpec:
    """What the model config says about its KV cache (for one TP rank)."""

    model: str
    use_mla: bool
    block_size: int
    cache_dtype: str  # "auto" resolved to the model dtype, or "fp8", "fp8_e4m3", "fp8_ds_mla"
    total_kv_heads: int  # across all TP ranks; 1 for MLA
    head_dim: int  # per head; the latent width (kv_lora_rank + rope) for MLA
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def kv_heads_per_rank(self) -> int:
        if self.use_mla:
            return 1
        return max(1, self.total_kv_heads // self.tp_size)

    @classmethod
    def from_vllm_config(cls, vllm_config: Any, tp_rank: int = 0) -> ModelKVSpec:
        model_config = vllm_config.model_config
        cache_config = vllm_config.cache_config
        parallel = vllm_config.parallel_config
        cache_dtype = str(cache_config.cache_dtype)
        if cache_dtype == "auto":
            cache_dtype = str(model_config.dtype).removeprefix("torch.")
        use_mla = bool(model_config.use_mla)
        return cls(
            model=str(model_config.model), use_mla=use_mla,
            block_size=int(cache_config.block_size), cache_dtype=cache_dtype,
            total_kv_heads=1 if use_mla else int(model_config.get_total_num_kv_heads()),
            head_dim=int(model_config.get_head_size()),
            tp_size=int(parallel.tensor_parallel_size), tp_rank=tp_rank)


@dataclass(frozen=True)
class Region:
    """One dense byte range per block of a layer tensor."""

    offset: int  # bytes from the layer tensor's first element to block 0's range
    block_stride: int  # bytes between the ranges of consecutive blocks
    nbytes: int


@dataclass(frozen=True)
class KVCacheLayout:
    spec: ModelKVSpec
    kind: LayoutKind
    layer_names: tuple[str, ...]
    num_blocks: int
    dtype: torch.dtype
    shape: tuple[int, ...]  # of one layer's tensor
    regions: tuple[Region, ...]  # the same for every layer
    head_major: bool  # each head's bytes are one contiguous run inside a page region
    layer_stride: int | None  # bytes between consecutive layers if they tile one storage

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def page_bytes(self) -> int:
        return sum(r.nbytes for r in self.regions)

    @property
    def rank_agnostic(self) -> bool:
        """MLA pages are identical on every TP rank: stored once, loadable by any rank."""
        return self.kind is LayoutKind.MLA

    @property
    def kv_heads(self) -> int:
        return self.spec.kv_heads_per_rank

    def fingerprint(self) -> str:
        """Short id of everything prefill and decode must share for pages to be swappable.

        TP size is not part of it: a TP mismatch is handled (or refused) by `kvhelper.tp`.
        """
        spec = self.spec
        identity = {
            "format": FORMAT_VERSION, "model": spec.model, "mla": spec.use_mla,
            "cache_dtype": spec.cache_dtype, "block_size": spec.block_size,
            "kind": self.kind.value, "head_dim": spec.head_dim,
            "total_kv_heads": spec.total_kv_heads, "dtype": str(self.dtype),
            "region_bytes_per_head": [r.nbytes // self.kv_heads for r in self.regions],
        }
        blob = json.dumps(identity, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def describe(self) -> str:
        return (f"{self.kind.value} layout, {self.num_layers} layers x {self.num_blocks} blocks, "
                f"page {self.page_bytes} B, shape {list(self.shape)} {self.dtype}")


def describe_kv_caches(kv_caches: Mapping[str, torch.Tensor], spec: ModelKVSpec,
                       num_blocks: int | None = None) -> KVCacheLayout:
    """Describe the per-layer cache tensors vLLM passes to `register_kv_caches`."""
    if not kv_caches:
        raise LayoutError("no KV cache tensors were registered")
    names = tuple(kv_caches)
    first = kv_caches[names[0]]
    for name in names[1:]:
        other = kv_caches[name]
        if (other.shape, other.stride(), other.dtype, other.device) != (
                first.shape, first.stride(), first.dtype, first.device):
            raise LayoutError(
                f"layer {name} has shape {list(other.shape)} strides {list(other.stride())} "
                f"{other.dtype}, but layer {names[0]} has {list(first.shape)} "
                f"{list(first.stride())} {first.dtype}: mixed layouts are not supported")
    kind, blocks, regions, head_major = _detect(first, spec, num_blocks, names[0])
    return KVCacheLayout(spec=spec, kind=kind, layer_names=names, num_blocks=blocks,
                         dtype=first.dtype, shape=tuple(first.shape), regions=regions,
                         head_major=head_major,
                         layer_stride=_uniform_layer_stride([kv_caches[n] for n in names]))


def _detect(t: torch.Tensor, spec: ModelKVSpec, num_blocks: int | None,
            name: str) -> tuple[LayoutKind, int, tuple[Region, ...], bool]:
    shape, size = tuple(t.shape), t.element_size()
    n = spec.block_size
    seen = f"layer {name}: shape {list(shape)}, strides {list(t.stride())}, {t.dtype}"
    if spec.use_mla:
        row = _mla_row_elements(spec, size, seen)
        if len(shape) == 4 and shape[1] == 1 and shape[2:] == (n, row):
            return LayoutKind.MLA, shape[0], (_block_region(t[:, 0], seen),), True
        if len(shape) == 3 and shape[1:] == (n, row):
            return LayoutKind.MLA, shape[0], (_block_region(t, seen),), True
        raise LayoutError(f"MLA cache not understood ({seen}); expected (blocks, {n}, {row}) "
                          f"or (blocks, 1, {n}, {row}) for block size {n}")
    h, d = spec.kv_heads_per_rank, spec.head_dim
    if len(shape) == 4 and shape[1:] == (h, n, 2 * d):
        region = _block_region(t, seen)
        return LayoutKind.PACKED, shape[0], (region,), _heads_outermost(t[0], 0)
    kv_first = len(shape) == 5 and shape[0] == 2 and shape[2:] == (n, h, d)
    block_kv = len(shape) == 5 and shape[1] == 2 and shape[2:] == (n, h, d)
    if kv_first and block_kv:
        if num_blocks is None or num_blocks == 2:
            raise LayoutError(f"ambiguous K/V cache ({seen}): (2, B, N, H, D) or (B, 2, N, H, D)"
                              "; pass num_blocks to tell them apart")
        kv_first, block_kv = shape[1] == num_blocks, shape[0] == num_blocks
    if kv_first:
        k = _block_region(t[0], seen)
        v_offset = t.stride(0) * size
        v = Region(v_offset + k.offset, k.block_stride, k.nbytes)
        return LayoutKind.KV_FIRST, shape[1], (k, v), False
    if block_kv:
        return LayoutKind.BLOCK_KV, shape[0], (_block_region(t, seen),), False
    raise LayoutError(
        f"K/V cache not understood ({seen}); for block size {n}, {h} KV heads per rank and "
        f"head size {d} expected (blocks, {h}, {n}, {2 * d}), (2, blocks, {n}, {h}, {d}) or "
        f"(blocks, 2, {n}, {h}, {d})")


def _mla_row_elements(spec: ModelKVSpec, element_size: int, seen: str) -> int:
    if spec.cache_dtype == "fp8_ds_mla":
        if element_size != 1:
            raise LayoutError(f"fp8_ds_mla pages are bytes, got {element_size}-byte elements "
                              f"({seen})")
        return FP8_DS_MLA_ROW_BYTES
    return spec.head_dim


def _block_region(blocks: torch.Tensor, seen: str) -> Region:
    """The dense byte range of each block of a block-first tensor (any order inside a block)."""
    inner_shape, inner_strides = blocks.shape[1:], blocks.stride()[1:]
    numel = 1
    for dim in inner_shape:
        numel *= dim
    span = 1 + sum((dim - 1) * stride for dim, stride in zip(inner_shape, inner_strides,
                                                             strict=True))
    if span != numel or any(s < 0 for s in blocks.stride()):
        raise LayoutError(f"a block's elements are not one dense range ({seen}); pages cannot "
                          "be moved whole")
    if blocks.shape[0] > 1 and blocks.stride(0) < numel:
        raise LayoutError(f"blocks overlap in memory ({seen})")
    size = blocks.element_size()
    return Region(offset=0, block_stride=blocks.stride(0) * size, nbytes=numel * size)


def _heads_outermost(block: torch.Tensor, head_dim_index: int) -> bool:
    """Inside one block, is every head's data one contiguous run (heads dim has the largest
    stride)? Then a page splits by head into byte ranges, which TP re-sharding needs."""
    strides = block.stride()
    return all(strides[head_dim_index] >= s for s in strides)


def _uniform_layer_stride(tensors: list[torch.Tensor]) -> int | None:
    if len(tensors) < 2:
        return None
    storage = tensors[0].untyped_storage().data_ptr()
    if any(t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    starts = [t.data_ptr() for t in tensors]
    stride = starts[1] - starts[0]
    if stride <= 0 or any(b - a != stride for a, b in zip(starts, starts[1:], strict=False)):
        return None
    return stride
