"""Benchmark: gather/scatter of a 4k-token request's KV pages, against baselines in the same run.

Baselines: (1) a plain contiguous tensor copy of the same number of bytes (the memcpy ceiling;
target ≥ 0.8x), and (2) a per-token slot-mapping gather, the older connectors' approach
(`cache.view(-1, row)[slot_mapping]` per layer; target: pages ≥ 5x faster). Cases: DeepSeek-V2-Lite
MLA (27 layers, 576-wide latent, bf16) and a Llama-8B-like GQA cache (32 layers, 8 KV heads x 128,
bf16) in both the packed CPU layout and the legacy (2, B, N, H, D) layout. Bounded: fixed sizes,
a few repetitions.

    .venv-serving/bin/python benchmarks/kv_pages.py [--tokens 4096] [--repeat 5]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from kvhelper.layout import ModelKVSpec, describe_kv_caches
from kvhelper.pages import PageMover

BLOCK = 16


def best_of(repeat: int, fn: Callable[[], object]) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def caches(shape: tuple[int, ...], layers: int) -> dict[str, torch.Tensor]:
    numel = 1
    for dim in shape:
        numel *= dim
    storage = torch.empty(layers * numel, dtype=torch.bfloat16).normal_()
    return {f"layers.{i}": storage[i * numel:(i + 1) * numel].view(shape) for i in range(layers)}


def run_case(name: str, spec: ModelKVSpec, shape: tuple[int, ...], layers: int, tokens: int,
             repeat: int, per_token: Callable[[dict[str, torch.Tensor], torch.Tensor,
                                               torch.Tensor], None] | None) -> None:
    kv = caches(shape, layers)
    layout = describe_kv_caches(kv, spec, num_blocks=shape[1] if shape[0] == 2 else shape[0])
    mover = PageMover(layout, kv)
    blocks = tokens // BLOCK
    # A realistic block table: scattered, not consecutive.
    block_ids = torch.randperm(layout.num_blocks)[:blocks]
    buffer = torch.empty(mover.nbytes(blocks), dtype=torch.uint8)
    nbytes = buffer.numel()
    source = torch.empty(nbytes, dtype=torch.uint8).random_(0, 255)
    target = torch.empty(nbytes, dtype=torch.uint8)

    copy_s = best_of(repeat, lambda: target.copy_(source))
    gather_s = best_of(repeat, lambda: mover.gather(block_ids, buffer))
    scatter_s = best_of(repeat, lambda: mover.scatter(block_ids, buffer))
    gbps = nbytes / 1e9
    print(f"{name}: {layout.describe()}")
    print(f"  request: {tokens} tokens = {blocks} pages x {layers} layers "
          f"= {nbytes / 2**20:.1f} MiB")
    print(f"  plain copy of the same bytes: {gbps / copy_s:6.2f} GB/s (baseline)")
    print(f"  gather:                       {gbps / gather_s:6.2f} GB/s "
          f"= {copy_s / gather_s:.2f}x the plain copy (target >= 0.8x)")
    print(f"  scatter:                      {gbps / scatter_s:6.2f} GB/s "
          f"= {copy_s / scatter_s:.2f}x the plain copy (target >= 0.8x)")
    if per_token is not None:
        slots = (block_ids[:, None] * BLOCK + torch.arange(BLOCK)[None, :]).reshape(-1)
        out = torch.empty(nbytes, dtype=torch.uint8)
        token_s = best_of(repeat, lambda: per_token(kv, slots, out))
        print(f"  per-token slot-mapping gather: {gbps / token_s:6.2f} GB/s; pages are "
              f"{token_s / gather_s:.1f}x faster (target >= 5x)")


def mla_per_token(kv: dict[str, torch.Tensor], slots: torch.Tensor, out: torch.Tensor) -> None:
    """The older approach: per layer, index the cache token by token through the slot mapping."""
    rows = out.view(torch.bfloat16).view(len(kv), slots.numel(), -1)
    for layer, cache in enumerate(kv.values()):
        rows[layer] = cache.reshape(-1, cache.shape[-1])[slots]


def kv_first_per_token(kv: dict[str, torch.Tensor], slots: torch.Tensor,
                       out: torch.Tensor) -> None:
    """The older approach on the legacy layout: key and value caches indexed per token."""
    rows = out.view(torch.bfloat16).view(len(kv), 2, slots.numel(), -1)
    for layer, cache in enumerate(kv.values()):
        heads, dim = cache.shape[-2], cache.shape[-1]
        rows[layer, 0] = cache[0].reshape(-1, heads * dim)[slots]
        rows[layer, 1] = cache[1].reshape(-1, heads * dim)[slots]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    blocks = 2 * args.tokens // BLOCK  # the cache holds twice the request
    mla = ModelKVSpec("deepseek-ai/DeepSeek-V2-Lite", True, BLOCK, "bfloat16", 1, 576)
    run_case("MLA", mla, (blocks, BLOCK, 576), 27, args.tokens, args.repeat, mla_per_token)
    gqa = ModelKVSpec("meta-llama/Llama-3.1-8B", False, BLOCK, "bfloat16", 8, 128)
    run_case("GQA packed", gqa, (blocks, 8, BLOCK, 256), 32, args.tokens, args.repeat, None)
    run_case("GQA legacy", gqa, (2, blocks, BLOCK, 8, 128), 32, args.tokens, args.repeat,
             kv_first_per_token)
    print(f"threads: {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
