"""Time to first token and decode speed through the proxy of a local 1P2D deployment, against
the same requests on one ordinary vLLM instance, with the KV bytes moved per request; both
measured in this run and printed side by side.

    .venv-serving/bin/python benchmarks/local_1p2d.py [--kind mla|gqa] [--requests 16]

Runs every server on loopback; as root it re-executes itself in a private network namespace.
Bounded: a fixed number of requests, each with a timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from disagg_devtools.local.cli import load, with_tiny_model
from disagg_devtools.local.metrics import scrape_total
from disagg_devtools.local.runner import LocalDeployment, RunFolder, local_defaults, stop_recorded
from disagg_devtools.processes import free_port, isolate_benchmark

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = aiohttp.ClientTimeout(total=300)


def prompt(i: int, tokens: int, vocab: int) -> list[int]:
    """Request i's prompt: `tokens` token ids, different for every i (no shared prefixes)."""
    return [10 + (i * 7919 + j * 104729) % (vocab - 10) for j in range(tokens)]


async def one(session: aiohttp.ClientSession, url: str, model: str, prompt_ids: list[int],
              max_tokens: int) -> tuple[float, float, int]:
    """(time to first token, seconds from first to last token, tokens) of a streamed request."""
    body = {"model": model, "prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    started = time.perf_counter()
    first = last = 0.0
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status == 200, await response.text()
        async for raw in response.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data:"))
            if event.get("choices") and event["choices"][0].get("text") is not None:
                now = time.perf_counter()
                first = first or now
                last = now
                tokens += 1
    return first - started, last - first, tokens


async def measure(url: str, model: str, requests: int, tokens: int, vocab: int,
                  max_tokens: int, offset: int) -> list[tuple[float, float, int]]:
    async with aiohttp.ClientSession() as session:
        await one(session, url, model, prompt(10_000 + offset, tokens, vocab), 4)  # warm-up
        return [await one(session, url, model, prompt(offset + i, tokens, vocab), max_tokens)
                for i in range(requests)]


def summarize(label: str, rows: list[tuple[float, float, int]]) -> str:
    ttft = sorted(r[0] for r in rows)
    speed = [(r[2] - 1) / r[1] for r in rows if r[1] > 0]
    return (f"{label:<22} TTFT p50 {statistics.median(ttft) * 1000:7.1f} ms  "
            f"p90 {ttft[int(0.9 * (len(ttft) - 1))] * 1000:7.1f} ms   "
            f"decode {statistics.mean(speed):6.1f} tokens/s per request")


def start_single(python: str, model: Path, served: str, extra_args: list[str],
                 log: Path) -> tuple[subprocess.Popen[bytes], str]:
    """One ordinary vLLM server, with the decode instances' own extra arguments."""
    port = free_port()
    process = subprocess.Popen(
        [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
         "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port),
         "--block-size", "32", "--max-model-len", "1024", "--dtype", "bfloat16", *extra_args],
        # Its own process group, not its own session, as the local runner starts instances.
        stdout=log.open("wb"), stderr=subprocess.STDOUT, process_group=0,
        env={**os.environ, **local_defaults()})  # the settings the local runner gives vLLM
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return process, url
        except OSError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:]
            raise SystemExit(f"single instance did not start:\n{tail}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--kind", choices=["mla", "gqa"], default="mla")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    isolate_benchmark()  # stopped with kill: still stop what it started; own loopback
    with tempfile.TemporaryDirectory(prefix="bench-1p2d-") as scratch:
        folder = RunFolder(Path(scratch))
        name, spec = load(ROOT / "examples" / f"tiny-{args.kind}-1p2d.yaml", None)
        spec = with_tiny_model(spec, folder, sys.executable)
        model, served = Path(spec.model.name), spec.model.served_model_name or name
        vocab = int(json.loads((model / "config.json").read_text())["vocab_size"])
        deployment = LocalDeployment(name, spec, folder, proxy_port=free_port(),
                                     echo=lambda _: None)
        try:
            url = asyncio.run(deployment.up(timeout=900))
            decodes = [f"http://127.0.0.1:{i.spec.port}" for i in deployment.started
                       if i.spec.role == "decode" and i.spec.port]  # not the registrars
            loaded_before = scrape_total(decodes, "vllm:kvhelper_bytes_loaded_total")
            disagg = asyncio.run(measure(url, served, args.requests, args.prompt_tokens, vocab,
                                         args.max_tokens, 0))
            # vLLM publishes connector stats on its logging interval, not per response.
            deadline = time.monotonic() + 30
            while (scrape_total(decodes, "vllm:kvhelper_requests_loaded_total")
                   < args.requests + 1 and time.monotonic() < deadline):
                time.sleep(0.5)
            moved = scrape_total(decodes, "vllm:kvhelper_bytes_loaded_total") - loaded_before
        finally:
            stop_recorded(folder, lambda _: None)
        single, single_url = start_single(sys.executable, model, served,
                                          list(spec.decode.extra_args),
                                          Path(scratch) / "single.log")
        try:
            alone = asyncio.run(measure(single_url, served, args.requests, args.prompt_tokens,
                                        vocab, args.max_tokens, 0))
        finally:
            os.killpg(single.pid, 15)
            single.wait(30)
    print(f"tiny {args.kind.upper()} model, {args.requests} sequential streamed requests of "
          f"{args.prompt_tokens} prompt tokens and {args.max_tokens} tokens, vLLM CPU build")
    print(summarize("1P2D through the proxy", disagg))
    print(summarize("one instance", alone))
    ratio = statistics.median(r[0] for r in disagg) / statistics.median(r[0] for r in alone)
    print(f"TTFT ratio (1P2D / one instance): {ratio:.2f}x")
    print(f"KV loaded by decode: {moved / max(1, args.requests + 1) / 1024:.0f} KiB per request")


if __name__ == "__main__":
    main()
