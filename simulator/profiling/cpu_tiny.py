"""Measure the tiny MLA model on this machine's CPU through a real local 1P2D deployment (real
vLLM, Mooncake, etcd, proxy) and write the simulator's `tiny-mla-cpu` profile:

- prefill: one request at a time straight to the prefill instance, prompts of several lengths;
- decode: B streams at once straight to a decode instance, the gaps between their tokens;
- transfer: one request at a time through the proxy; what its time to first token adds to the
  prefill and one decode step is the proxy, the store's put and get and the hand-over;
- store load: a prompt straight to the prefill instance, then the same prompt and a few tokens
  more, whose stored blocks prefill's own lookup loads: the load times its connector logs;
- context: what those prompts' first token took beyond the prefill of the few tokens and the
  load, per loaded token (vLLM's MLA prefill expands the cached latent again in the step).

    .venv-serving/bin/python simulator/profiling/cpu_tiny.py \\
        --out simulator/src/disagg_sim/profiles/tiny-mla-cpu.yaml
    .venv-serving/bin/python simulator/profiling/cpu_tiny.py --model tiny-mla-compute \\
        --out simulator/src/disagg_sim/profiles/tiny-mla-compute-cpu.yaml

About four minutes on 2 cores. As root it runs in a private network namespace.
benchmarks/sim_validation.py measures a profile this way before each of its replays.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from fitting import fit  # beside this script

ROOT = Path(__file__).resolve().parents[2]
PREFILL_LENGTHS = [32, 128, 256, 512, 768]
DECODE_BATCHES = [1, 4, 8, 16]
DECODE_PROMPTS = [64, 512]
REPEATS = 9
GENERATED = 48
STORE_HIT_LENGTHS = [128, 256, 512, 768]
STORE_HIT_TAIL = 16  # tokens after the stored prompt, computed
LOADED = re.compile(r"loaded (\d+) KV blocks \((\d+) bytes\) from the store in ([0-9.]+) ms")


def prompt(length: int, rng: random.Random, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(length)]


async def timed_request(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                        ) -> list[float]:
    """Seconds from sending to each streamed token."""
    began = time.perf_counter()
    marks: list[float] = []
    async with session.post(f"{url}/v1/completions", json={**body, "stream": True}) as answer:
        answer.raise_for_status()
        async for raw in answer.content:
            if raw.startswith(b"data: {"):
                marks.append(time.perf_counter() - began)
    return marks


async def measure(prefill: str, decode: str, proxy: str, model: str, vocab: int
                  ) -> dict[str, Any]:
    rng = random.Random(0)
    base = {"model": model, "temperature": 0, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        for _ in range(3):  # warm-up
            await timed_request(session, prefill, {**base, "prompt": prompt(64, rng, vocab),
                                                   "max_tokens": 1})
        prefill_points = []
        for length in PREFILL_LENGTHS:
            times = [(await timed_request(session, prefill, {
                **base, "prompt": prompt(length, rng, vocab), "max_tokens": 1}))[0]
                for _ in range(REPEATS)]
            prefill_points.append((length, statistics.median(times)))
        decode_points = []
        for context in DECODE_PROMPTS:
            for batch in DECODE_BATCHES:
                runs = await asyncio.gather(*(timed_request(session, decode, {
                    **base, "prompt": prompt(context, rng, vocab), "max_tokens": GENERATED})
                    for _ in range(batch)))
                gaps = [b - a for marks in runs for a, b in zip(marks[8:], marks[9:],
                                                                 strict=False)]
                decode_points.append((batch, context + GENERATED // 2, statistics.median(gaps)))
        proxy_points = []
        for length in PREFILL_LENGTHS[1:]:
            times = [(await timed_request(session, proxy, {
                **base, "prompt": prompt(length, rng, vocab), "max_tokens": 2}))[0]
                for _ in range(REPEATS)]
            proxy_points.append((length, statistics.median(times)))
        hit_points = []
        for length in STORE_HIT_LENGTHS:
            times = []
            for _ in range(REPEATS):
                stored = prompt(length, rng, vocab)
                for tokens in (stored, stored + prompt(STORE_HIT_TAIL, rng, vocab)):
                    marks = await timed_request(session, prefill, {**base, "prompt": tokens,
                                                                   "max_tokens": 1})
                times.append(marks[0])  # the second: its stored blocks loaded, 16 computed
            hit_points.append((length, statistics.median(times)))
    return {"prefill": prefill_points, "decode": decode_points, "proxy": proxy_points,
            "store_hits": hit_points}


def store_loads(prefill_log: str) -> list[tuple[int, float]]:
    """(bytes, seconds) of each load the prefill instance's connector logged."""
    return [(int(m.group(2)), float(m.group(3)) / 1000) for m in LOADED.finditer(prefill_log)]



def measure_profile(echo: Callable[[str], None] | None = None, model: str = "tiny-mla"
                    ) -> dict[str, Any]:
    """Start a local 1P2D deployment of the project's MLA `model` (`tiny-mla`, or the
    compute-sized `tiny-mla-compute`), measure it and return the profile (the YAML file's
    content). Call it inside a private network namespace."""
    from disagg_devtools.local.cli import load, with_tiny_model
    from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
    from disagg_devtools.processes import free_port
    from disagg_devtools.tiny_models import VOCAB

    with tempfile.TemporaryDirectory(prefix="sim-profile-") as scratch:
        folder = RunFolder(Path(scratch))
        name, spec = load(ROOT / "examples" / "tiny-mla-1p2d.yaml", model)
        spec = with_tiny_model(spec, folder, sys.executable)
        config = json.loads((Path(spec.model.name) / "config.json").read_text())
        bytes_per_token = config["num_hidden_layers"] * (
            config["kv_lora_rank"] + config["qk_rope_head_dim"]) * 2
        deployment = LocalDeployment(name, spec, folder, proxy_port=free_port(),
                                     echo=echo or (lambda line: print(line, file=sys.stderr)))
        began = time.monotonic()
        try:
            proxy = asyncio.run(deployment.up(timeout=900))
            startup = time.monotonic() - began
            urls = {role: [f"http://127.0.0.1:{i.spec.port}" for i in deployment.started
                           if i.spec.role == role and i.spec.port]
                    for role in ("prefill", "decode")}
            points = asyncio.run(measure(urls["prefill"][0], urls["decode"][0], proxy,
                                         spec.model.served_model_name or name, VOCAB))
            prefill_log = next(i.log for i in deployment.started if i.spec.role == "prefill")
            points["store"] = store_loads(prefill_log.read_text(errors="replace"))
        finally:
            stop_recorded(folder, lambda _: None)
    return build_profile(points, startup, bytes_per_token, model)


def fit_transfer(points: list[tuple[int, float]], bytes_per_token: float
                 ) -> tuple[dict[str, float], float, bool]:
    """latency + tokens * bytes_per_token / bandwidth over (tokens, seconds) points; when the
    per-token term is below what the points resolve, the median as latency and 1 GB/s.
    Returns the section, the fit's largest relative error, and whether bandwidth was fitted."""
    (latency, per_token), error = fit([[1, n] for n, _ in points],
                                      [max(t, 1e-4) for _, t in points])
    fitted = per_token >= 1e-7
    if not fitted:
        latency = max(0.0, statistics.median(t for _, t in points))
        per_token = bytes_per_token / 1e9
    return ({"bytes_per_token": bytes_per_token,
             "bandwidth_bytes_per_s": bytes_per_token / max(per_token, 1e-9),
             "latency_s": latency}, error, fitted)


def fit_context(hits: list[tuple[int, float]], prefill_s_after: Callable[[int, int], float],
                load: dict[str, float], bytes_per_token: float) -> tuple[float, float]:
    """Seconds per cached token a step reads again: from (cached tokens, time to first token)
    of prompts that computed STORE_HIT_TAIL tokens after loading the rest, what is left after
    that compute and the load (the `store_load` section's form). Returns it and the largest
    error of the fitted times, relative."""
    def known(cached: int) -> float:
        return (prefill_s_after(STORE_HIT_TAIL, cached) + load["latency_s"]
                + cached * bytes_per_token / load["bandwidth_bytes_per_s"])

    if not hits:
        return 0.0, 0.0
    per_token = max(0.0, sum(c * (t - known(c)) for c, t in hits) / sum(c * c for c, _ in hits))
    error = max(abs(known(c) + per_token * c - t) / t for c, t in hits)
    return per_token, error


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--out", type=Path, required=True, help="the profile file to write")
    cli.add_argument("--model", choices=["tiny-mla", "tiny-mla-compute"], default="tiny-mla")
    cli.add_argument("--engine-threads", type=int, default=1,
                     help="OpenMP threads per engine, unbound, as the replays run them (0: "
                     "vLLM's own binding)")
    args = cli.parse_args()
    from disagg_devtools.processes import isolate_benchmark

    isolate_benchmark()  # stopped with kill: still stop what it started; own loopback
    from disagg_devtools.local.runner import share_cores

    share_cores(args.engine_threads)
    args.out.write_text(yaml.safe_dump(measure_profile(model=args.model), sort_keys=False,
                                       width=100))


def build_profile(points: dict[str, Any], startup: float, bytes_per_token: float,
                  model: str = "tiny-mla") -> dict[str, Any]:
    (p_base, p_token, p_context), p_error = fit([[1, n, n * n / 2] for n, _ in points["prefill"]],
                                                [t for _, t in points["prefill"]])
    (d_base, d_seq, d_ctx), d_error = fit([[1, b, b * c] for b, c, _ in points["decode"]],
                                          [t for *_, t in points["decode"]])

    def prefill_s(n: int) -> float:
        return prefill_s_after(n, 0)

    def prefill_s_after(n: int, cached: int) -> float:
        return p_base + p_token * n + p_context * n * (cached + n / 2)

    measured = "measured here by simulator/profiling/cpu_tiny.py"
    extra = [(n, t - prefill_s(n) - (d_base + d_seq + d_ctx * n)) for n, t in points["proxy"]]
    transfer, t_error, fitted = fit_transfer(extra, bytes_per_token)
    unresolved = ("assumption: 1 GB/s; the tiny model's pages (under 2 MB a prompt) move "
                  "faster than these figures resolve, so the time is its median overhead")
    bandwidth_note = f"{measured}: the per-token term of the fit" if fitted else unresolved
    loads = [(int(b / bytes_per_token), t) for b, t in points["store"] if b]
    store_load, s_error, s_fitted = fit_transfer(loads, bytes_per_token) if loads else (
        None, 0.0, False)
    per_context, hit_error = fit_context(points.get("store_hits", []), prefill_s_after,
                                         store_load or transfer, bytes_per_token)
    profile = {
        "name": f"{model}-cpu",
        "description": f"the project's {model} model (vLLM CPU build, bfloat16, block 32) on "
                       f"this {os.cpu_count()}-core machine, one process per instance",
        "prefill": {"base_s": p_base, "per_token_s": p_token, "per_token_context_s": p_context,
                    "max_batched_tokens": 2048, "gpus": 1, "per_context_token_s": per_context},
        "decode": {"base_s": d_base, "per_sequence_s": d_seq, "per_context_token_s": d_ctx,
                   "max_sequences": 128, "kv_capacity_tokens": 1_000_000, "gpus": 1},
        "transfer": transfer,
        "store_capacity_bytes": 3 * 256 * 2**20,
        **({"store_load": store_load} if store_load else {}),
        "engine_prefix_cache": False,
        "engine_cache_tokens": 0,
        "startup_s": round(startup, 1),
        "store_lookup_s": 0.0005,
        "shared_cores": True,
        "sources": {
            "prefill": f"{measured}: median of {REPEATS} requests straight to the prefill "
                       f"instance, max_tokens 1, prompts {PREFILL_LENGTHS}: "
                       f"{[round(t * 1000, 1) for _, t in points['prefill']]} ms "
                       f"(fit error up to {p_error:.1%})",
            "decode": f"{measured}: median gap between streamed tokens, batch {DECODE_BATCHES}"
                      f" x prompt {DECODE_PROMPTS}: "
                      f"{[round(t * 1000, 1) for *_, t in points['decode']]} ms "
                      f"(fit error up to {d_error:.1%})",
            "transfer": f"{measured}: time to first token through the proxy minus prefill and "
                        f"one decode step, prompts {[n for n, _ in extra]}: "
                        f"{[round(e * 1000, 1) for _, e in extra]} ms "
                        f"(fit error up to {t_error:.1%})",
            "transfer.bytes_per_token": "the tiny model's layers x (kv_lora_rank + rope) x 2",
            "transfer.bandwidth_bytes_per_s": bandwidth_note,
            "store_load": f"{measured}: the load times prefill's connector logged for "
                          f"{len(loads)} prompts sent again with {STORE_HIT_TAIL} tokens more "
                          f"(stored {STORE_HIT_LENGTHS} tokens; the store read and the "
                          f"scatter into the cache), median "
                          f"{statistics.median(t for _, t in loads) * 1000 if loads else 0:.1f}"
                          f" ms (fit error up to {s_error:.1%}); bandwidth: "
                          + ("the per-token term of the fit" if s_fitted else unresolved),
            "store_hits": f"{measured}: time to first token straight to the prefill "
                          f"instance of prompts whose first {STORE_HIT_LENGTHS} tokens it loads "
                          f"from the store, {STORE_HIT_TAIL} computed: "
                          f"{[round(t * 1000, 1) for _, t in points.get('store_hits', [])]} ms",
            "prefill.per_context_token_s": f"{measured}: those store hits' time beyond the "
                                           f"prefill of {STORE_HIT_TAIL} tokens and the store "
                                           "load, per loaded token (least squares through 0, "
                                           f"error up to {hit_error:.1%} of the hits' time): "
                                           "vLLM's MLA prefill expands the cached latent "
                                           "through kv_b_proj in every step that attends to it",
            "prefill.max_batched_tokens": "vLLM CPU default max_num_batched_tokens (2048)",
            "decode.max_sequences": "vLLM CPU default max_num_seqs for the API server (128)",
            "decode.kv_capacity_tokens": "assumption: more than the replays use (the tiny "
                                         "model's KV is small)",
            "store_capacity_bytes": "the example's globalSegmentSize (256 MiB) x 3 instances",
            "engine_prefix_cache": "vLLM's CPU build turns prefix caching off for MLA",
            "startup_s": f"{measured}: the 1P2D deployment's start, all processes",
            "shared_cores": "the local deployment's engines all run on this machine's "
                            f"{os.cpu_count()} cores, each using all of them (vLLM's CPU "
                            "build); the figures above are each engine's alone",
        },
    }
    return profile


if __name__ == "__main__":
    main()
