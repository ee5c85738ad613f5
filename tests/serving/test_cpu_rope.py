"""kvhelper's fix of vLLM's CPU rotary embedding on MLA models (kvhelper/vllm_cpu_rope.py): the
kernel alone, and an engine whose answer must not depend on how a prompt was split. vLLM's own
prefix cache splits it here (no connector): each prompt computed whole, then its tail over its
cached blocks, in float32. With the fix they agree within the exactness tolerance; without it
(the negative control) they do not."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from disagg_devtools.exactness import TOLERANCE, compare

from .engines import run_engine


def test_mla_shaped_queries_and_keys_rotate_as_vllms_pytorch_formula() -> None:
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    from kvhelper import vllm_cpu_rope

    assert vllm_cpu_rope.exact()
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(64, 64, 2048, 10000.0, False, torch.float32)
    generator = torch.Generator().manual_seed(0)
    latent, heads = torch.randn(6, 576, generator=generator), torch.randn(6, 4, 128,
                                                                          generator=generator)
    positions = torch.arange(100, 106)
    want = rope.forward_native(positions, heads[..., 64:].clone(),
                               latent[:, 512:].unsqueeze(1).clone())
    got = rope.forward_cpu(positions, heads[..., 64:], latent[:, 512:].unsqueeze(1))
    assert torch.allclose(got[0], want[0]) and torch.allclose(got[1], want[1])
    # GQA's flat query and key keep vLLM's kernel.
    query, key = torch.randn(6, 256, generator=generator), torch.randn(6, 128,
                                                                       generator=generator)
    flat = rope.forward_cpu(positions, query.clone(), key.clone())
    native = rope.forward_native(positions, query.clone(), key.clone())
    assert torch.allclose(flat[0], native[0], atol=1e-5)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "unfixed"])
def test_an_mla_prompts_tail_over_cached_blocks_answers_as_the_whole_prompt(
        fixed: bool, tiny_models, tmp_path: Path) -> None:
    rng = random.Random(3)
    # A one-token tail, a few tokens, a whole block: the lengths that showed the bug.
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (289, 296, 304)]
    result, _ = run_engine(tmp_path, "prefix-cache", {
        "model": str(tiny_models["mla"]), "prompts": prompts, "max_tokens": 8,
        "max_model_len": 1024, "logprobs": 2, "engine_args": {"dtype": "float32"},
        "warm_prefix_cache": True, "one_at_a_time": True},
        env={"KVHELPER_CPU_ROPE_FIX": "on" if fixed else "off"})
    gaps = [compare(i, [int(step[0][0]) for step in tail], [step[0][1] for step in tail], whole)
            for i, (whole, tail) in enumerate(zip(result["cold_logprobs"], result["logprobs"],
                                                  strict=True))]
    print(f"{'fixed' if fixed else 'unfixed'}: {gaps}")
    if fixed:
        assert all(g.exact and g.largest <= TOLERANCE / 10 for g in gaps), gaps
    else:
        assert not all(g.exact for g in gaps), gaps
