"""Tiny random-weight models generated locally (no model hub): a GQA Llama and an MLA DeepSeek.

They load in vLLM's CPU build in seconds and exercise the same KV layouts as their full-size
relatives (GQA: 2 KV heads of 64; MLA: a 576-wide latent). Greedy output is meaningless text
but deterministic, which is what equality tests need.

Two sizes: `tiny` (the tests' models; a prompt costs about as much as the hops around it) and
`compute` (wider and deeper, so that prefill dominates: a 700-token prefill takes a few hundred
ms on one thread here, as a real model's does on its accelerator; what the capacity benchmark
serves). The KV layout per layer is the same in both.

    python -m disagg_devtools.tiny_models {gqa,mla} OUT_DIR [--size compute]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VOCAB = 512
# Wider than transformers' 0.02 so that logits are peaked: with 0.02 the top tokens tie in
# bf16 and greedy output is decided by rounding noise, which no equality test survives.
INIT_RANGE = 0.3
# Seeds whose greedy outputs for the connector tests' prompts have no exactly tied step in
# vLLM 0.32's CPU build (seed 0 of the GQA model had one).
GQA_SEED, MLA_SEED = 1, 2
_CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "prefill computes the prompt and decode generates the answer",
    "a key value cache holds attention state for every token",
    "disaggregated serving moves pages between instances",
] * 50


def _tokenizer(out: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    from tokenizers import decoders

    tokenizer.decoder = decoders.ByteLevel()
    wrapped = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call,unused-ignore]
        tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    wrapped.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}")
    wrapped.save_pretrained(out)


@dataclass(frozen=True)
class Size:
    hidden: int
    intermediate: int
    layers: int
    heads: int  # query heads (MLA: also its K/V heads before the latent projection)
    experts_intermediate: int  # MLA's routed and shared experts


_TINY = Size(hidden=128, intermediate=256, layers=2, heads=4, experts_intermediate=64)
# Measured on this machine's CPU build (one OpenMP thread, bfloat16, 700 random tokens):
# GQA 218 to 239 ms per prefill and 7 ms per decode step; MLA with 6 layers 479 to 519 ms
# (its reference CPU attention expands the latent), hence 4: 345 to 368 ms, 9 ms per step.
SIZES = {
    ("gqa", "tiny"): _TINY, ("mla", "tiny"): _TINY,
    ("gqa", "compute"): Size(hidden=512, intermediate=1536, layers=6, heads=8,
                             experts_intermediate=384),
    ("mla", "compute"): Size(hidden=512, intermediate=1536, layers=4, heads=8,
                             experts_intermediate=384),
}
# Model names a DisaggServing may use for these models (disagg-local generates them).
MODEL_NAMES = {"tiny-mla": ("mla", "tiny"), "tiny-gqa": ("gqa", "tiny"),
               "tiny-mla-compute": ("mla", "compute"), "tiny-gqa-compute": ("gqa", "compute")}


def _common(size: Size) -> dict[str, Any]:
    return {"vocab_size": VOCAB, "hidden_size": size.hidden,
            "intermediate_size": size.intermediate, "num_hidden_layers": size.layers,
            "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16", "tie_word_embeddings": False,
            "initializer_range": INIT_RANGE}


def _save(config: Any, model_class: Any, out: Path, seed: int) -> None:
    import torch

    torch.manual_seed(seed)
    model = model_class(config).to(torch.bfloat16)
    model.save_pretrained(out)


def make_gqa(out: Path, seed: int = GQA_SEED, size: str = "tiny") -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    shape = SIZES["gqa", size]
    config = LlamaConfig(**_common(shape), num_attention_heads=shape.heads,
                         num_key_value_heads=2, head_dim=64)
    _save(config, LlamaForCausalLM, out, seed)
    _tokenizer(out)
    return out


def make_mla(out: Path, seed: int = MLA_SEED, dense: bool = False, size: str = "tiny") -> Path:
    """`dense`: every layer's MLP dense (no experts), for vLLM's CPU data parallelism, whose
    MoE layers would gather tokens across ranks through a collective the CPU build lacks."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    shape = SIZES["mla", size]
    # Read by vLLM's DeepSeek implementation, unknown to transformers' typed signature.
    vllm_only: dict[str, Any] = {"topk_method": "noaux_tc", "scoring_func": "sigmoid",
                                 "rope_scaling": None}
    config = DeepseekV3Config(
        **_common(shape), **vllm_only, num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=64,
        v_head_dim=64, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=shape.experts_intermediate,
        first_k_dense_replace=shape.layers if dense else 1, n_group=1, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=1.0)
    _save(config, DeepseekV3ForCausalLM, out, seed)
    _tokenizer(out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description="Generate a tiny random-weight model.")
    parser.add_argument("kind", choices=["gqa", "mla"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--size", choices=sorted({size for _, size in SIZES}), default="tiny")
    args = parser.parse_args()
    (make_gqa if args.kind == "gqa" else make_mla)(args.out, size=args.size)
    print(args.out)


if __name__ == "__main__":
    main()
