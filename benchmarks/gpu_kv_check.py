"""KV pages on a GPU, in one run: kvhelper's page gather/scatter is byte-exact on the device,
how fast it is against the device's own copies, and the staging path through a real Mooncake
store against raw host<->device copies and raw Mooncake put/get. Prints one table at the end and
writes the full log (log.txt) and the figures (results.json) to --out.

    python3 benchmarks/gpu_kv_check.py --out DIR                 # one CUDA GPU: under 8 minutes
    python3 benchmarks/gpu_kv_check.py --out DIR --device cpu --quick   # what CI runs

1. Correctness, on fresh random bytes every time (never zeros), for every layout kvhelper
   moves: MLA latent rows (DeepSeek-V2-Lite, 27 layers, 576 wide, block sizes 16 and 64, both
   tensor shapes vLLM uses), DeepSeek-V3 (61 layers; also fp8_ds_mla's 656-byte rows), and
   Llama-3.1-8B (32 layers, 8 KV heads of 128) in the packed, K/V-first and block-K/V layouts.
   Each run poisons the destination blocks and the transfer buffer, gathers scattered source
   blocks and scatters them into other blocks (both buffer orders); the buffer must equal an
   independent reading of the source pages, and the whole cache must equal its copy with only
   the destination blocks replaced: every byte written, nothing else touched. Head shards (a
   store_tp_size above the TP size) are read back from a staged host buffer by address.
2. Speed of gather and scatter for a 4k- and a 32k-token request: GB/s counting bytes read and
   written, against a device-to-device copy of the same bytes in the same run (target: at least
   0.8x) and the device's copy ceiling (one large copy). Timed with device events after
   warm-up, the median of many repeats, rotating block sets and buffers so that no repeat finds
   the last one's bytes in cache.
3. The staging path: a real mooncake_master on loopback; a 4k-token request's pages go from a
   device cache through kvhelper's StagedBlockIO into the store and back into another device
   cache at other blocks (bytes compared), against raw pinned-host<->device copies and raw
   Mooncake put/get of the same bytes (target: at least 0.8x the slower raw path), with where
   the time goes (gather, device to host, put; get, host to device, scatter).

Needs PyTorch, kvhelper (this repository's kvhelper/src on PYTHONPATH) and, for part 3, the
Mooncake wheel (mooncake-transfer-engine-non-cuda: it stores from host memory, which is what the
staging path hands it) with libibverbs1. On a GPU machine with no package index, carry them:
`benchmarks/gpu_kv_check.sh fetch` downloads the wheel and the Debian packages here, and
`benchmarks/gpu_kv_check.sh run OUT` installs them there and runs this script.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "kvhelper" / "src"))

from kvhelper.layout import KVCacheLayout, LayoutKind, ModelKVSpec, describe_kv_caches  # noqa: E402
from kvhelper.pages import PageMover  # noqa: E402
from kvhelper.tp import store_sharding  # noqa: E402

POISON = 0xA5
TARGET = 0.8


@dataclass(frozen=True)
class Shape:
    """One model's KV cache on one rank, as vLLM allocates it: every layer a view into one
    storage, in the layout `kind`."""
    name: str
    model: str
    kind: LayoutKind
    layers: int
    block_size: int
    heads: int = 1  # KV heads on this rank (1: MLA)
    head_dim: int = 576  # per head; MLA: the latent row (kv_lora_rank + rope)
    cache_dtype: str = "bfloat16"
    four_dim_mla: bool = False  # (B, 1, N, L) rather than (B, N, L)
    total_heads: int = 1
    tp_size: int = 1

    @property
    def use_mla(self) -> bool:
        return self.kind is LayoutKind.MLA

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8 if self.cache_dtype == "fp8_ds_mla" else torch.bfloat16

    def layer_shape(self, blocks: int) -> tuple[int, ...]:
        n, h, d = self.block_size, self.heads, self.head_dim
        if self.kind is LayoutKind.MLA:
            row = 656 if self.cache_dtype == "fp8_ds_mla" else d
            return (blocks, 1, n, row) if self.four_dim_mla else (blocks, n, row)
        if self.kind is LayoutKind.PACKED:
            return (blocks, h, n, 2 * d)
        if self.kind is LayoutKind.KV_FIRST:
            return (2, blocks, n, h, d)
        return (blocks, 2, n, h, d)

    def spec(self) -> ModelKVSpec:
        return ModelKVSpec(self.model, self.use_mla, self.block_size, self.cache_dtype,
                           self.total_heads, self.head_dim, self.tp_size, 0)


V2_LITE = "deepseek-ai/DeepSeek-V2-Lite"
V3 = "deepseek-ai/DeepSeek-V3"
LLAMA = "meta-llama/Llama-3.1-8B"
CORRECTNESS = [
    Shape("V2-Lite MLA bs16", V2_LITE, LayoutKind.MLA, 27, 16),
    Shape("V2-Lite MLA bs64", V2_LITE, LayoutKind.MLA, 27, 64),
    Shape("V2-Lite MLA bs64 4-d", V2_LITE, LayoutKind.MLA, 27, 64, four_dim_mla=True),
    Shape("V3 MLA bs64", V3, LayoutKind.MLA, 61, 64),
    Shape("V3 fp8_ds_mla bs64", V3, LayoutKind.MLA, 61, 64, cache_dtype="fp8_ds_mla"),
    Shape("Llama-8B packed bs16", LLAMA, LayoutKind.PACKED, 32, 16, 8, 128, total_heads=8),
    Shape("Llama-8B K/V-first bs16", LLAMA, LayoutKind.KV_FIRST, 32, 16, 8, 128,
          total_heads=8),
    Shape("Llama-8B block-K/V bs16", LLAMA, LayoutKind.BLOCK_KV, 32, 16, 8, 128,
          total_heads=8),
]
# Head shards: (shape, store_tp_size). A TP-2 rank holds 4 of the 8 heads.
SHARDED = [
    (Shape("Llama-8B packed TP1", LLAMA, LayoutKind.PACKED, 32, 16, 8, 128, total_heads=8), 2),
    (Shape("Llama-8B packed TP1", LLAMA, LayoutKind.PACKED, 32, 16, 8, 128, total_heads=8), 8),
    (Shape("Llama-8B packed TP2", LLAMA, LayoutKind.PACKED, 32, 16, 4, 128, total_heads=8,
           tp_size=2), 4),
]
SPEED = [
    Shape("V2-Lite MLA bs64", V2_LITE, LayoutKind.MLA, 27, 64),
    Shape("V3 MLA bs64", V3, LayoutKind.MLA, 61, 64),
    Shape("Llama-8B K/V-first bs16", LLAMA, LayoutKind.KV_FIRST, 32, 16, 8, 128,
          total_heads=8),
]


# -- the run's log and figures -----------------------------------------------------------------

@dataclass
class Report:
    out: Path
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)  # part, case, figure, ok
    results: dict[str, Any] = field(default_factory=dict)
    failed: int = 0

    def __post_init__(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        self._log = (self.out / "log.txt").open("w")

    def log(self, text: str) -> None:
        print(text, flush=True)
        self._log.write(text + "\n")
        self._log.flush()

    def row(self, part: str, case: str, figure: str, ok: bool | None) -> None:
        verdict = "-" if ok is None else ("ok" if ok else "FAILED")
        self.failed += ok is False
        self.rows.append((part, case, figure, verdict))
        self.log(f"[{part}] {case}: {figure} {verdict}")

    def finish(self) -> None:
        widths = [max(len(r[i]) for r in [("part", "case", "figure", ""), *self.rows])
                  for i in range(4)]
        lines = ["", "  ".join(h.ljust(w) for h, w in zip(("part", "case", "figure", ""),
                                                           widths, strict=True))]
        lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True))
                  for r in self.rows]
        lines.append(f"{len(self.rows)} rows, {self.failed} failed")
        self.log("\n".join(lines))
        self.results["failed"] = self.failed
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2) + "\n")
        self._log.close()


# -- caches ------------------------------------------------------------------------------------

def make_cache(shape: Shape, blocks: int, device: torch.device
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One storage of random bytes (never all zeros) and the per-layer views vLLM registers."""
    per_layer = 1
    for dim in shape.layer_shape(blocks):
        per_layer *= dim
    element = torch.empty(0, dtype=shape.dtype).element_size()
    raw = torch.empty(shape.layers * per_layer * element, dtype=torch.uint8, device=device)
    raw.random_(0, 256)
    typed = raw.view(shape.dtype)
    layers = {f"model.layers.{i}.self_attn.attn":
              typed[i * per_layer:(i + 1) * per_layer].view(shape.layer_shape(blocks))
              for i in range(shape.layers)}
    return raw, layers


def block_bytes(layer: torch.Tensor, kind: LayoutKind) -> torch.Tensor:
    """A layer's bytes with blocks first and each block's regions in kvhelper's buffer order
    (K/V-first: K then V): read with plain indexing, independently of kvhelper."""
    as_bytes = layer.view(torch.uint8)
    return as_bytes.transpose(0, 1) if kind is LayoutKind.KV_FIRST else as_bytes


def expected_buffer(layers: dict[str, torch.Tensor], kind: LayoutKind, ids: torch.Tensor,
                    order: str) -> torch.Tensor:
    per_layer = [block_bytes(t, kind)[ids].reshape(len(ids), -1) for t in layers.values()]
    stacked = torch.stack(per_layer)  # (layers, blocks, page bytes)
    return (stacked if order == "layer" else stacked.transpose(0, 1)).reshape(-1)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 1. correctness ----------------------------------------------------------------------------

def check_case(shape: Shape, blocks: int, request_blocks: int, device: torch.device,
               mover_factory: Callable[[KVCacheLayout, dict[str, torch.Tensor]], PageMover]
               = PageMover) -> list[str]:
    """Gather then scatter in both orders; the problems found (none: byte-exact)."""
    raw, layers = make_cache(shape, blocks, device)
    layout = describe_kv_caches(layers, shape.spec(), num_blocks=blocks)
    if layout.kind is not shape.kind:
        return [f"detected {layout.kind.value}, expected {shape.kind.value}"]
    mover = mover_factory(layout, layers)
    problems = []
    for order in ("layer", "block"):
        raw.random_(0, 256)  # fresh bytes for every run
        order_ids = torch.randperm(blocks, device=device)
        source, target = order_ids[:request_blocks], order_ids[request_blocks:2 * request_blocks]
        for t in layers.values():  # poison the destination
            block_bytes(t, shape.kind)[target] = POISON
        want = expected_buffer(layers, shape.kind, source, order)
        expected_cache = _with_blocks_copied(raw, layers, shape, source, target)
        buffer = torch.full((mover.nbytes(request_blocks),), POISON ^ 0xFF, dtype=torch.uint8,
                            device=device)
        mover.gather(source, buffer, order=order)  # type: ignore[arg-type]
        if not torch.equal(buffer, want):
            wrong = int((buffer != want).sum())
            problems.append(f"{order}-major gather: {wrong} of {buffer.numel()} bytes differ")
        mover.scatter(target, buffer, order=order)  # type: ignore[arg-type]
        synchronize(device)
        if not torch.equal(raw, expected_cache):
            wrong = int((raw != expected_cache).sum())
            problems.append(f"{order}-major scatter: {wrong} of {raw.numel()} cache bytes "
                            "differ from the expected cache")
    return problems


def _with_blocks_copied(raw: torch.Tensor, layers: dict[str, torch.Tensor], shape: Shape,
                        source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """What the whole cache must be after the scatter: its copy with `target` blocks of every
    layer set to the `source` blocks' bytes, and nothing else changed."""
    expected = raw.clone()
    typed = expected.view(shape.dtype)
    for t in layers.values():
        mirror = typed.as_strided(t.shape, t.stride(), t.storage_offset())
        view = block_bytes(mirror, shape.kind)
        view[target] = block_bytes(t, shape.kind)[source]
    return expected


def check_shards(shape: Shape, store_tp: int, blocks: int, request_blocks: int,
                 device: torch.device) -> list[str]:
    """Each head shard's pieces, read by address from a staged host buffer, equal those heads
    of the source pages."""
    _, layers = make_cache(shape, blocks, device)
    pages = [t.view(torch.uint8) for t in layers.values()]
    layout = describe_kv_caches(layers, shape.spec(), num_blocks=blocks)
    mover = PageMover(layout, layers)
    sharding = store_sharding(shape.total_heads, shape.tp_size, 0, store_tp)
    source = torch.randperm(blocks, device=device)[:request_blocks]
    staged = torch.empty(mover.nbytes(request_blocks), dtype=torch.uint8,
                         pin_memory=device.type == "cuda")
    staged.copy_(mover.gather(source, order="block"))
    piece = mover.piece_bytes(sharding.piece_heads()[0])
    problems = []
    for heads in sharding.piece_heads():
        first, count = heads if heads is not None else (0, shape.heads)
        spans = mover.buffer_spans(staged.data_ptr(), request_blocks, heads)
        for b, pieces in enumerate(spans):
            for layer, address in enumerate(pieces):
                got = ctypes.string_at(address, piece)
                page = pages[layer][source[b]]
                want = page[first:first + count].contiguous().cpu().numpy().tobytes()
                if got != want:
                    problems.append(f"heads {first}..{first + count - 1}, block {b}, layer "
                                    f"{layer}: the piece differs")
                    return problems
    return problems


def part_correctness(report: Report, device: torch.device, quick: bool) -> None:
    blocks, request = (24, 8) if quick else (512, 192)
    for shape in CORRECTNESS:
        problems = check_case(shape, blocks, request, device)
        report.results.setdefault("correctness", {})[shape.name] = problems
        report.row("1", shape.name, "byte-exact, both orders" if not problems
                   else "; ".join(problems), not problems)
    for shape, store_tp in SHARDED:
        name = f"{shape.name} store_tp_size {store_tp}"
        problems = check_shards(shape, store_tp, blocks, request, device)
        report.results.setdefault("correctness", {})[name] = problems
        report.row("1", name, "head-shard pieces byte-exact" if not problems
                   else "; ".join(problems), not problems)


# -- 2. speed ----------------------------------------------------------------------------------

class Timer:
    """Seconds of `fn()` on the device: CUDA events, or the wall clock with a sync on CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000
        began = time.perf_counter()
        fn()
        return time.perf_counter() - began

    def median(self, fns: list[Callable[[], object]], repeats: int, warmup: int = 3) -> float:
        """The median over `repeats` runs, cycling through `fns` (rotated buffers)."""
        for i in range(warmup):
            fns[i % len(fns)]()
        synchronize(self.device)
        return statistics.median(self(fns[i % len(fns)]) for i in range(repeats))


def gbps(nbytes: int, seconds: float) -> float:
    """Bytes read plus written per second, in GB/s."""
    return 2 * nbytes / seconds / 1e9


def copy_ceiling(device: torch.device, timer: Timer, nbytes: int, repeats: int) -> float:
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    target = torch.empty_like(source)
    return gbps(nbytes, timer.median([lambda: target.copy_(source)], repeats))


def judged(device: torch.device, met: bool) -> bool | None:
    """The speed targets are the GPU's: on a CPU the figures are printed, not judged."""
    return met if device.type == "cuda" else None


# Two block sets and buffers in turn are enough: every measured request (15 MiB on the CPU's
# quick run, 127 MiB and up on a GPU) is larger than a GPU's L2 (50-60 MB on an H100/H200), and
# more would not fit beside a 32k-token K/V-first cache (17 GiB with two sets).
ROTATE = 2


def part_speed(report: Report, device: torch.device, quick: bool, rotate: int = ROTATE) -> None:
    timer = Timer(device)
    repeats = 3 if quick else 30
    ceiling = copy_ceiling(device, timer, (32 << 20) if quick else (2 << 30), repeats)
    report.results["copy_ceiling_gbps"] = ceiling
    report.row("2", "copy ceiling (one large copy)", f"{ceiling:.0f} GB/s", None)
    for tokens in ((256, 1024) if quick else (4096, 32768)):
        for shape in SPEED:
            figures = speed_case(shape, tokens, device, timer, repeats, rotate)
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next case's cache is as large
            report.results.setdefault("speed", {})[f"{shape.name} {tokens}"] = figures
            for step in ("gather", "scatter"):
                ratio = figures[f"{step}_gbps"] / figures["copy_gbps"]
                report.row("2", f"{shape.name}, {tokens} tokens, {step}",
                           f"{figures[f'{step}_gbps']:.0f} GB/s = {ratio:.2f}x the same-size "
                           f"copy ({figures['copy_gbps']:.0f} GB/s, "
                           f"{figures['copy_gbps'] / ceiling:.2f}x ceiling); "
                           f"{figures['bytes'] / 2**20:.0f} MiB", judged(device, ratio >= TARGET))


def speed_case(shape: Shape, tokens: int, device: torch.device, timer: Timer, repeats: int,
               rotate: int) -> dict[str, float]:
    """Gather, scatter and a plain copy of one request's bytes; each repeat moves other blocks
    through another buffer, so nothing is in cache twice."""
    request = tokens // shape.block_size
    blocks = request * rotate + 1
    _, layers = make_cache(shape, blocks, device)
    mover = PageMover(describe_kv_caches(layers, shape.spec(), num_blocks=blocks), layers)
    nbytes = mover.nbytes(request)
    order_ids = torch.randperm(blocks, device=device)
    id_sets = [order_ids[i * request:(i + 1) * request] for i in range(rotate)]
    buffers = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(rotate)]
    sources = [torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
               for _ in range(rotate)]
    indices = range(rotate)
    gather = timer.median([lambda i=i: mover.gather(id_sets[i], buffers[i]) for i in indices],
                          repeats)
    scatter = timer.median([lambda i=i: mover.scatter(id_sets[i], buffers[i])
                            for i in indices], repeats)
    copy = timer.median([lambda i=i: buffers[i].copy_(sources[i]) for i in indices], repeats)
    return {"bytes": nbytes, "gather_gbps": gbps(nbytes, gather),
            "scatter_gbps": gbps(nbytes, scatter), "copy_gbps": gbps(nbytes, copy)}


# -- 3. the staging path -----------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def mooncake_master(folder: Path) -> Iterator[str]:
    """A mooncake_master from the Mooncake wheel, on loopback, until the block ends."""
    import mooncake

    binary = Path(mooncake.__file__).parent / "mooncake_master"
    found = str(binary) if binary.exists() else shutil.which("mooncake_master")
    if found is None:
        raise FileNotFoundError("no mooncake_master: install mooncake-transfer-engine-non-cuda")
    port = free_port()
    with (folder / "master.log").open("wb") as log:
        process = subprocess.Popen([found, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                                    f"--metrics_port={free_port()}"], stdout=log,
                                   stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
                break
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mooncake_master did not start: "
                                   + (folder / "master.log").read_text()[-2000:])
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(10)


def part_staging(report: Report, device: torch.device, quick: bool) -> None:
    os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    from kvhelper.block_io import DEFAULT_STAGING_BYTES, StagedBlockIO, value_keys
    from kvhelper.store import MooncakeConfig, MooncakeKVStore

    shape = SPEED[0]  # DeepSeek-V2-Lite, FlashMLA's block size
    tokens = 512 if quick else 4096
    request = tokens // shape.block_size
    timer = Timer(device)
    repeats = 3 if quick else 10
    with tempfile.TemporaryDirectory() as work, mooncake_master(Path(work)) as master:
        _, layers = make_cache(shape, 2 * request, device)
        _, other_layers = make_cache(shape, 2 * request, device)
        layout = describe_kv_caches(layers, shape.spec(), num_blocks=2 * request)
        mover = PageMover(layout, layers)
        other = PageMover(describe_kv_caches(other_layers, shape.spec(), 2 * request),
                          other_layers)
        nbytes = mover.nbytes(request)
        store = MooncakeKVStore(MooncakeConfig(
            master_server_address=master, global_segment_size=max(4 * nbytes, 256 << 20),
            local_buffer_size=64 << 20, local_hostname="127.0.0.1"))
        staged_src = StagedBlockIO(store, mover, [None], DEFAULT_STAGING_BYTES)
        staged_dst = StagedBlockIO(store, other, [None], DEFAULT_STAGING_BYTES)
        source = torch.randperm(2 * request, device=device)[:request].tolist()
        target = torch.randperm(2 * request, device=device)[:request].tolist()
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        pinned_in = torch.empty_like(pinned)
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
        store.register(pinned)
        store.register(pinned_in)
        per_block = nbytes // request
        times: dict[str, list[float]] = {}
        problems: list[str] = []

        def timed(step: str, fn: Callable[[], object]) -> None:
            synchronize(device)
            began = time.perf_counter()
            fn()
            synchronize(device)
            times.setdefault(step, []).append(time.perf_counter() - began)

        for round_ in range(repeats + 1):  # the first round warms up
            fingerprint = f"gpu-check-{round_}"
            keys = value_keys(fingerprint, [f"{i:064x}" for i in range(request)], None)
            raw_keys = [f"raw-{round_}-{i}" for i in range(request)]
            spans = [pinned.data_ptr() + i * per_block for i in range(request)]
            spans_in = [pinned_in.data_ptr() + i * per_block for i in range(request)]
            timed("staged store", lambda keys=keys: staged_src.store(keys, source))
            timed("staged load", lambda keys=keys: staged_dst.load_job(keys, target)())
            timed("device to host", lambda: pinned.copy_(on_device))
            timed("host to device", lambda: on_device.copy_(pinned))
            timed("raw put", lambda k=raw_keys, s=spans: store._store.batch_put_from(  # noqa: SLF001
                k, s, [per_block] * request))
            timed("raw get", lambda k=raw_keys, s=spans_in: store._store.batch_get_into(  # noqa: SLF001
                k, s, [per_block] * request))
            if round_ == 0:
                for step in times:
                    times[step].clear()
                problems = [name for (name, a), b in zip(layers.items(), other_layers.values(),
                                                          strict=True)
                            if not torch.equal(a[source].view(torch.uint8),
                                               b[target].view(torch.uint8))]
            for key in keys + raw_keys:
                store.remove(key, force=True)
        gather = timer.median([lambda: mover.gather(source, on_device, order="block")], repeats)
        scatter = timer.median([lambda: other.scatter(target, on_device, order="block")],
                               repeats)
        staged_src.close()
        staged_dst.close()
        store.unregister(pinned)
        store.unregister(pinned_in)
        store.close()
    median = {step: statistics.median(values) for step, values in times.items()}
    rate = {step: nbytes / seconds / 1e9 for step, seconds in median.items()}
    report.results["staging"] = {"bytes": nbytes, "seconds": median, "GBps": rate,
                                 "gather_s": gather, "scatter_s": scatter,
                                 "layers_differing": problems}
    report.row("3", f"{shape.name}, {tokens} tokens, round trip through the store",
               "bytes equal" if not problems else f"{len(problems)} layers differ", not problems)
    for step, raw_steps in (("staged store", ("device to host", "raw put")),
                            ("staged load", ("raw get", "host to device"))):
        slower = min(rate[s] for s in raw_steps)
        ratio = rate[step] / slower
        report.row("3", f"{shape.name}, {tokens} tokens, {step}",
                   f"{rate[step]:.2f} GB/s = {ratio:.2f}x the slower raw path "
                   f"({' / '.join(f'{s} {rate[s]:.2f}' for s in raw_steps)} GB/s)",
                   judged(device, ratio >= TARGET))
    ms = {step: seconds * 1e3 for step, seconds in median.items()}
    report.row("3", "where a store's time goes",
               f"gather {gather * 1e3:.2f} ms, device to host {ms['device to host']:.2f} ms, "
               f"put {ms['raw put']:.2f} ms; staged {ms['staged store']:.2f} ms in all", None)
    report.row("3", "where a load's time goes",
               f"get {median['raw get'] * 1e3:.2f} ms, host to device "
               f"{median['host to device'] * 1e3:.2f} ms, scatter {scatter * 1e3:.2f} ms; staged "
               f"{median['staged load'] * 1e3:.2f} ms in all", None)


# -- the run -----------------------------------------------------------------------------------

def describe(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, "
                f"{props.multi_processor_count} SMs; torch {torch.__version__}")
    return f"CPU {platform.processor() or platform.machine()}, {os.cpu_count()} cores; " \
           f"torch {torch.__version__}"


def main() -> int:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--out", type=Path, required=True, help="folder for log.txt and results.json")
    cli.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    cli.add_argument("--quick", action="store_true", help="small sizes and few repeats (CI)")
    cli.add_argument("--parts", type=int, nargs="+", default=[1, 2, 3])
    args = cli.parse_args()
    device = torch.device(args.device)
    report = Report(args.out)
    began = time.perf_counter()
    report.results["device"] = describe(device)
    report.log(f"device: {report.results['device']}; quick: {args.quick}")
    torch.manual_seed(int(time.time()))  # fresh data on every run
    for part, run in ((1, part_correctness), (2, part_speed), (3, part_staging)):
        if part in args.parts:
            run(report, device, args.quick)
    report.results["seconds"] = time.perf_counter() - began
    report.log(f"measured on {report.results['device']} in {report.results['seconds']:.0f} s")
    report.finish()
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
