"""Benchmark: a 4k-token request's KV through kvhelper's store path vs raw Mooncake, one run.

The connector's two paths (`kvhelper.block_io`), over a cache laid out as vLLM lays it out:
direct (CPU caches: each block's value straight from and into the cache, one piece per layer)
and staged (device caches: pages gathered into a registered host buffer, then stored; loads the
other way). Raw baseline: `batch_put_from`/`batch_get_into` of the same bytes from/into a
registered buffer, the same number of keys (target: the connector >= 0.8x).
Cases: MLA (DeepSeek-V2-Lite shapes) with vLLM's CPU block size (16) and with FlashMLA's (64),
and GQA (Llama-3.1-8B shapes). Also prints bytes per token for each, and for the project's tiny
MLA and GQA test models.

Starts its own mooncake_master on loopback; Mooncake binds every interface, so as root it
re-runs itself inside a private network namespace (`unshare -n`).

    .venv-serving/bin/python benchmarks/kv_store.py [--tokens 4096]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from disagg_devtools.master_process import MooncakeMaster
from kvhelper.block_io import DEFAULT_STAGING_BYTES, DirectBlockIO, StagedBlockIO
from kvhelper.keys import block_key
from kvhelper.layout import ModelKVSpec, describe_kv_caches
from kvhelper.pages import PageMover
from kvhelper.store import MooncakeConfig, MooncakeKVStore

BLOCK = 16  # tokens per block: vLLM's CPU MLA backend requires 16
FLASHMLA_BLOCK = 64  # FlashMLA's (GPU) block size: 4x fewer, 4x larger pages per key


def private_network() -> bool:
    lines = Path("/proc/self/net/dev").read_text().splitlines()[2:]
    return [line.split(":")[0].strip() for line in lines] == ["lo"]


def timed(fn) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def run_case(store: MooncakeKVStore, name: str, spec: ModelKVSpec, shape: tuple[int, ...],
             layers: int, tokens: int, rounds: int) -> None:
    numel = 1
    for dim in shape:
        numel *= dim
    storage = torch.empty(layers * numel, dtype=torch.bfloat16).normal_()
    caches = {f"l{i}": storage[i * numel:(i + 1) * numel].view(shape) for i in range(layers)}
    layout = describe_kv_caches(caches, spec)
    mover = PageMover(layout, caches)
    blocks = tokens // spec.block_size
    ids = torch.randperm(layout.num_blocks)[:blocks].tolist()
    other = torch.randperm(layout.num_blocks)[:blocks].tolist()
    per_block = layout.page_bytes * layers
    # The connector's two paths, as it builds them: direct on CPU caches, staging on devices.
    direct = DirectBlockIO(store, mover, [None])
    staged = StagedBlockIO(store, mover, [None], DEFAULT_STAGING_BYTES)
    request_bytes = mover.nbytes(blocks)
    raw_src = torch.empty(request_bytes, dtype=torch.uint8).random_(0, 255)
    raw_dst = torch.empty_like(raw_src)
    for buffer in (raw_src, raw_dst):
        store.register(buffer)
    sizes = [per_block] * blocks
    best = dict.fromkeys(["raw_put", "raw_get", "put", "get", "reput", "dput", "dget", "dreput",
                          "mput", "mget"], 1e9)
    pieces = per_block // mover.row_bytes  # the direct path's pieces per key, same sizes
    for round_ in range(rounds):  # fresh keys each round; the best time of each step counts
        keys = [block_key(layout.fingerprint(), f"{name}-{round_}-{i:060x}")
                for i in range(blocks)]
        raw_keys = [f"raw/{name}/{round_}/{i}" for i in range(blocks)]

        def raw_put(raw_keys: list[str] = raw_keys) -> None:
            codes = store._store.batch_put_from(  # noqa: SLF001 - the raw baseline
                raw_keys, [raw_src.data_ptr() + i * per_block for i in range(blocks)], sizes)
            assert all(c == 0 for c in codes), codes

        def raw_get(raw_keys: list[str] = raw_keys) -> None:
            store._store.batch_get_into(  # noqa: SLF001
                raw_keys, [raw_dst.data_ptr() + i * per_block for i in range(blocks)], sizes)

        def store_request(keys: list[str] = keys) -> None:
            result = staged.store(keys, ids)
            assert not result.failed, result.failed

        def load_request(keys: list[str] = keys) -> None:
            failed = staged.load_job(keys, other)()
            assert not failed, failed

        direct_keys = [f"{key}/direct" for key in keys]
        multi_keys = [f"{key}/multi" for key in raw_keys]

        def piece_spans(base: int) -> list[list[int]]:
            return [[base + i * per_block + j * mover.row_bytes for j in range(pieces)]
                    for i in range(blocks)]

        def raw_multi_put(keys: list[str] = multi_keys) -> None:
            result = store.put_parts(keys, piece_spans(raw_src.data_ptr()), mover.row_bytes,
                                     skip_existing=False)
            assert not result.failed, result.failed

        def raw_multi_get(keys: list[str] = multi_keys) -> None:
            failed = store.get_parts(keys, piece_spans(raw_dst.data_ptr()), mover.row_bytes)
            assert not failed, failed

        def direct_store(keys: list[str] = direct_keys) -> None:
            result = direct.store(keys, ids)
            assert not result.failed, result.failed

        def direct_load(keys: list[str] = direct_keys) -> None:
            failed = direct.load_job(keys, other)()
            assert not failed, failed

        for step, fn in (("raw_put", raw_put), ("put", store_request), ("raw_get", raw_get),
                         ("get", load_request), ("reput", store_request),
                         ("dput", direct_store), ("dget", direct_load),
                         ("dreput", direct_store),
                         ("mput", raw_multi_put), ("mget", raw_multi_get)):
            best[step] = min(best[step], timed(fn))
        for key in keys + raw_keys + direct_keys + multi_keys:  # keep the store from filling up
            store.remove(key, force=True)
    raw_put_s, raw_get_s = best["raw_put"], best["raw_get"]
    put_s, get_s, reput_s = best["put"], best["get"], best["reput"]
    gib = request_bytes / 2**30
    print(f"{name}: {layout.describe()}")
    print(f"  request: {tokens} tokens, {blocks} keys of {per_block / 2**10:.0f} KiB = "
          f"{request_bytes / 2**20:.1f} MiB; {request_bytes / tokens:.0f} bytes per token")
    print(f"  raw batch_put_from:   {gib / raw_put_s:6.2f} GiB/s (best of {rounds})")
    print(f"  staged store:         {gib / put_s:6.2f} GiB/s = {raw_put_s / put_s:.2f}x raw "
          f"({staged.describe()}: gather + skip-existing check + put; the device-cache path)")
    print(f"  raw batch_get_into:   {gib / raw_get_s:6.2f} GiB/s (best of {rounds})")
    print(f"  staged load:          {gib / get_s:6.2f} GiB/s = {raw_get_s / get_s:.2f}x raw "
          "(get + scatter)")
    print(f"  direct store:         {gib / best['dput']:6.2f} GiB/s = "
          f"{raw_put_s / best['dput']:.2f}x raw (cache -> store, skip-existing check included; "
          "the CPU-cache path; target >= 0.8x)")
    print(f"  direct load:          {gib / best['dget']:6.2f} GiB/s = "
          f"{raw_get_s / best['dget']:.2f}x raw (store -> cache; target >= 0.8x)")
    print(f"  raw multi-buffer:     put {raw_put_s / best['mput']:.2f}x, get "
          f"{raw_get_s / best['mget']:.2f}x raw ({pieces} pieces of {mover.row_bytes} B per key "
          "from one buffer: Mooncake's own cost of the direct path's piece count)")
    print(f"  storing it again:     direct {best['dreput'] * 1000:.1f} ms, staged "
          f"{reput_s * 1000:.1f} ms (all {blocks} values already stored: an existence check)")
    for buffer in (raw_src, raw_dst):
        store.unregister(buffer)
    direct.close()
    staged.close()


def main(tokens: int, rounds: int) -> None:
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    with (tempfile.TemporaryDirectory() as work,
          MooncakeMaster(Path(work) / "master.log") as master):
        store = MooncakeKVStore(MooncakeConfig(
            master_server_address=master.address, global_segment_size=8 << 30,
            local_buffer_size=64 << 20, local_hostname="127.0.0.1"))
        blocks = 2 * tokens // BLOCK
        mla = ModelKVSpec("deepseek-ai/DeepSeek-V2-Lite", True, BLOCK, "bfloat16", 1, 576)
        run_case(store, "MLA", mla, (blocks, BLOCK, 576), 27, tokens, rounds)
        mla64 = ModelKVSpec("deepseek-ai/DeepSeek-V2-Lite", True, FLASHMLA_BLOCK, "bfloat16", 1,
                            576)
        run_case(store, "MLA-64", mla64, (2 * tokens // FLASHMLA_BLOCK, FLASHMLA_BLOCK, 576), 27,
                 tokens, rounds)
        gqa = ModelKVSpec("meta-llama/Llama-3.1-8B", False, BLOCK, "bfloat16", 8, 128)
        run_case(store, "GQA", gqa, (blocks, 8, BLOCK, 256), 32, tokens, rounds)
        store.close()
    print_tiny_model_bytes()


def print_tiny_model_bytes() -> None:
    """KV bytes per token the connector moves for the tiny test models (from their configs)."""
    import json

    from disagg_devtools import tiny_models

    with tempfile.TemporaryDirectory() as work:
        per_token = {}
        for kind, make in (("MLA", tiny_models.make_mla), ("GQA", tiny_models.make_gqa)):
            config = json.loads((make(Path(work) / kind) / "config.json").read_text())
            layers = config["num_hidden_layers"]
            if kind == "MLA":  # one latent row: kv_lora_rank + rope dims, bf16
                row = (config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
            else:  # K and V for every KV head, bf16
                row = 2 * config["num_key_value_heads"] * config["head_dim"] * 2
            per_token[kind] = layers * row
    print(f"tiny models: MLA {per_token['MLA']} bytes per token, GQA {per_token['GQA']} bytes "
          f"per token (MLA/GQA = {per_token['MLA'] / per_token['GQA']:.2f}; the tiny GQA model "
          "has only 2 KV heads of 64)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from disagg_devtools.processes import exit_on_sigterm

    exit_on_sigterm()  # stopped with kill: still stop what it started
    if not private_network():
        if os.geteuid() != 0:
            sys.exit("run as root (for `unshare -n`) or inside a private network namespace")
        os.execvp("unshare", ["unshare", "-n", "sh", "-c",
                              'ip link set lo up && exec "$0" "$@"', sys.executable,
                              *sys.argv])
    main(args.tokens, args.rounds)
