"""Replay whole conversations of the Mooncake conversation trace (disagg_sim's copy) through local
deployments of the tiny models, and report how much of the prompt work each one computes
against the ideal of a cluster-wide prefix cache, with TTFT and end-to-end latency; all stacks
measured in this run, on the same replay:

- `kvhelper`: the kvhelper connector with store lookups and the proxy's store-aware routing
  (with `--prefills 1 2`, one and two prefill instances);
- `kvhelper-save`: the same with decode saving (kvTransfer.saveDecodeCache), one prefill;
- `kvhelper-sync`: the same with stores inside prefill's step (save_async: false);
- `kvhelper-step-loads`: the same with decode's loads inside the step too (load_async: false);
- `kvhelper-lookup-async`: the same with prefill's own store hits loaded asynchronously
  (lookup_load_async: true), as before they loaded in the step;
- `kvhelper-local`: the same with proxy.localPrefillTokens (`--local-prefill-tokens`): a
  prompt whose unstored rest is that short goes straight to decode, which computes it;
- `kvhelper-no-routing` / `kvhelper-no-lookup`: the same with only prefill's store lookups, or
  only the proxy's store routing (which of the two costs or saves what);
- `reuse-off`: the same stack as before this feature: no store lookups, no store routing;
- `vllm-builtin`: vLLM's built-in MooncakeStoreConnector (kvTransfer.implementation: vllm)
  through the same proxy;
- `monolithic`: one ordinary vLLM instance with its own prefix cache.

    .venv-serving/bin/python benchmarks/trace_replay.py --kind mla --modulo 40 --limit 120

The mapping is deterministic: each trace hash id (a 512-token block) becomes one fixed block of
`--block-tokens` random token ids (one vLLM block), a partial last block keeps its share of
tokens, and prompts are capped at `--max-blocks` blocks, so the sharing structure is exact.
Whole conversations are sampled (requests whose second hash id is 0 modulo `--modulo`: all
turns of a conversation share their leading ids) and time is compressed `--speedup` times.
Bounded: a fixed number of requests, each with a timeout. As root it runs in a private network
namespace.

Every engine runs one unbound OpenMP thread (`--engine-threads`, 0 for vLLM's own binding;
disagg_devtools.local.runner.share_cores says why).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from disagg_sim.trace import CONVERSATION_TRACE, read_trace

ROOT = Path(__file__).resolve().parents[1]
TRACE = CONVERSATION_TRACE
TRACE_BLOCK = 512  # tokens per hash id in the trace
TIMEOUT = aiohttp.ClientTimeout(total=300)
COMPUTED = 'vllm:prompt_tokens_by_source_total{'
LOADED_BY_PREFILL = "vllm:kvhelper_lookup_hit_blocks_total{"  # kvhelper's connector only


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the start of the trace
    hash_ids: tuple[int, ...]
    input_length: int


# vLLM's reference CPU MLA backend overrides an MLA model's block size ("CPU MLA backend
# requires block_size=16") and turns the prefix cache off: the tiny MLA engines cache, hash and
# store 16-token blocks, though the examples ask for 32, and compute every prompt token they
# are not sent. On a CPU with AMX tiles vLLM picks its AMX_MLA backend instead, which keeps the
# spec's blocks and the prefix cache, as MLA engines on GPUs do; the tests force the reference
# backend (disagg_devtools.vllm_cpu_kernels). What a prefix cache can reuse is counted in the
# engine's blocks.
REFERENCE_CPU_MLA_BLOCK_TOKENS = 16


def reference_cpu_mla() -> bool:
    """Whether vLLM's CPU build runs MLA models on its reference backend here."""
    from disagg_devtools.vllm_cpu_kernels import ENV

    if os.environ.get(ENV) == "vector":
        return True
    import torch

    return not torch.cpu._is_amx_tile_supported()


def engine_block_tokens(kind: str, block_tokens: int) -> int:
    """The block size the tiny `kind` engines really use on this CPU build."""
    if kind == "mla" and reference_cpu_mla():
        return min(block_tokens, REFERENCE_CPU_MLA_BLOCK_TOKENS)
    return block_tokens


@dataclass(frozen=True)
class Replay:
    """Requests mapped onto a tiny model: prompt token ids and arrival times."""
    prompts: list[list[int]]
    arrivals: list[float]
    block_tokens: int  # tokens per trace hash id
    cache_block: int = 0  # tokens per engine cache block (0: block_tokens)

    @property
    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))

    def ideal_computed(self, timing: Outcome | None = None) -> int:
        """Prompt tokens an unbounded cluster-wide prefix cache would still compute: each
        prompt's full blocks after its longest prefix seen in an earlier prompt, and at least
        its last token (vLLM computes it), blocks being chained (a block is reusable only
        after the same whole prefix).

        With the `timing` of a replay, an earlier prompt's blocks count only once its first
        token came back before this prompt was sent: time compressed by the replay's speedup
        sends a conversation's next turn while the stack may still be computing the last."""
        return sum(len(prompt) - hit * self.engine_block
                   for prompt, (hit, _) in zip(self.prompts, self._hits(timing), strict=True))

    def reuse_classes(self) -> list[str]:
        """Per request, what an unbounded cluster-wide cache holds of its prompt: `whole` (every
        block decode could load: a prompt that can skip prefill), `part` or `cold`."""
        return ["cold" if not hit else "whole" if hit == usable else "part"
                for hit, usable in self._hits()]

    @property
    def engine_block(self) -> int:
        return self.cache_block or self.block_tokens

    def _hits(self, timing: Outcome | None = None) -> list[tuple[int, int]]:
        """Per prompt: its leading engine blocks seen in an earlier prompt (with `timing`:
        stored before it was sent), and the blocks usable."""
        size = self.engine_block
        stored_at: dict[int, float] = {}  # prefix -> when the first prompt holding it was done
        hits = []
        for index, prompt in enumerate(self.prompts):
            blocks = [tuple(prompt[i:i + size]) for i in range(0, len(prompt) - size + 1, size)]
            usable = (len(prompt) - 1) // size
            prefixes = [hash(tuple(blocks[:i + 1])) for i in range(len(blocks))]
            sent = timing.sent_at.get(index, math.inf) if timing else math.inf
            hit = 0
            while hit < usable and stored_at.get(prefixes[hit], math.inf) < sent:
                hit += 1
            hits.append((hit, usable))
            done = timing.first_at.get(index, math.inf) if timing else -math.inf
            for prefix in prefixes:
                stored_at[prefix] = min(stored_at.get(prefix, math.inf), done)
        return hits


def sample(trace: Path, modulo: int, max_blocks: int, limit: int) -> list[TraceRequest]:
    """Whole conversations: requests whose second hash id is 0 modulo `modulo` (all turns of a
    conversation share their leading ids), prompts capped at `max_blocks` blocks."""
    found = []
    for row in read_trace(trace):
        ids = row.hash_ids
        if len(ids) < 2 or ids[1] % modulo:
            continue
        length = min(row.input_length, max_blocks * TRACE_BLOCK)
        found.append(TraceRequest(row.timestamp_ms / 1000, tuple(ids[:max_blocks]), length))
        if len(found) >= limit:
            break
    return found


def map_to_tokens(requests: list[TraceRequest], block_tokens: int, vocab: int,
                  speedup: float, seed: int = 0, cache_block: int = 0) -> Replay:
    """Each hash id -> one fixed block of token ids; a partial last block keeps its share.
    `cache_block`: the engines' block size, when smaller than `block_tokens`."""
    blocks: dict[int, list[int]] = {}

    def block(hash_id: int) -> list[int]:
        if hash_id not in blocks:
            rng = random.Random(seed * 1_000_003 + hash_id)
            blocks[hash_id] = [rng.randrange(10, vocab) for _ in range(block_tokens)]
        return blocks[hash_id]

    prompts = []
    for request in requests:
        tokens: list[int] = []
        for index, hash_id in enumerate(request.hash_ids):
            covered = min(TRACE_BLOCK, request.input_length - index * TRACE_BLOCK)
            share = max(1, round(covered / TRACE_BLOCK * block_tokens))
            tokens += block(hash_id)[:share]
        prompts.append(tokens)
    start = requests[0].arrival if requests else 0.0
    return Replay(prompts, [(r.arrival - start) / speedup for r in requests], block_tokens,
                  cache_block)


@dataclass
class Outcome:
    ttft: list[float] = field(default_factory=list)
    e2e: list[float] = field(default_factory=list)
    failed: int = 0
    ttft_by_request: dict[int, float] = field(default_factory=dict)  # by index in the replay
    sent_at: dict[int, float] = field(default_factory=dict)  # seconds from the replay's start
    first_at: dict[int, float] = field(default_factory=dict)  # first token, same clock


async def replay(url: str, model: str, work: Replay, max_tokens: int,
                 concurrency: int = 16) -> Outcome:
    """Send every prompt at its arrival time (streamed); TTFT and end-to-end per request."""
    outcome = Outcome()
    limit = asyncio.Semaphore(concurrency)
    began = time.perf_counter()

    async def one(session: aiohttp.ClientSession, index: int, prompt: list[int], at: float
                  ) -> None:
        await asyncio.sleep(max(0.0, at - (time.perf_counter() - began)))
        async with limit:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                    "temperature": 0, "stream": True, "ignore_eos": True}
            started = time.perf_counter()
            outcome.sent_at[index] = started - began
            first = 0.0
            try:
                async with session.post(f"{url}/v1/completions", json=body,
                                        timeout=TIMEOUT) as response:
                    if response.status != 200:
                        outcome.failed += 1
                        return
                    async for raw in response.content:
                        if raw.startswith(b"data: {") and b'"error"' not in raw:
                            first = first or time.perf_counter()
            except (aiohttp.ClientError, TimeoutError):
                outcome.failed += 1
                return
            if not first:
                outcome.failed += 1
                return
            outcome.ttft.append(first - started)
            outcome.ttft_by_request[index] = first - started
            outcome.first_at[index] = first - began
            outcome.e2e.append(time.perf_counter() - started)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i, p, t) for i, (p, t) in
                               enumerate(zip(work.prompts, work.arrivals, strict=True))))
    return outcome


def tokens_by_source(metrics_text: str) -> dict[str, float]:
    """An instance's prompt tokens by where they came from (`local_compute`,
    `local_cache_hit`, `external_kv_transfer`)."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(COMPUTED):
            source = line.split('source="', 1)[1].split('"', 1)[0]
            found[source] = found.get(source, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


def computed_tokens(metrics_text: str) -> float:
    """Prompt tokens an instance computed itself (not from its prefix cache or a transfer)."""
    return tokens_by_source(metrics_text).get("local_compute", 0.0)


def store_loaded_blocks(metrics_text: str) -> float:
    """Blocks a prefill instance loaded from the store beyond its own prefix cache's hit."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
               if line.startswith(LOADED_BY_PREFILL))


def scrape(urls: list[str], parse: Callable[[str], float]) -> float:
    import urllib.request

    total = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            total += parse(response.read().decode())
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1)))] if ordered else 0.0


@dataclass
class Row:
    stack: str
    computed_share: float  # by the instances that prefill (all instances for monolithic)
    all_share: float  # every instance, decode's own recomputed tail included
    outcome: Outcome
    routes: dict[str, float]
    store: tuple[float, float] = (0.0, 0.0)  # keys and bytes the store held at the end
    # Mean seconds per request at the proxy: store lookup, prefill, decode to its first byte.
    phases: dict[str, float] = field(default_factory=dict)
    prefill_loaded_blocks: float = 0.0  # what prefill instances loaded from the store


PHASES = (("lookup", "disagg_proxy_store_lookup_seconds", ""),
          ("prefill", "disagg_proxy_phase_seconds", 'phase="prefill"'),
          ("decode", "disagg_proxy_phase_seconds", 'phase="decode"'))


def phase_totals(text: str) -> dict[str, float]:
    """Each proxy phase's histogram sum and count, as `PHASE_s` and `PHASE_n`."""
    totals: dict[str, float] = {}
    for phase, metric, label in PHASES:
        for line in text.splitlines():
            if label in line and line.startswith((f"{metric}_sum", f"{metric}_count")):
                key = f"{phase}_s" if line.startswith(f"{metric}_sum") else f"{phase}_n"
                totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def phase_means(text: str) -> dict[str, float]:
    """Where a request's time goes at the proxy: the mean of each phase's histogram."""
    totals = phase_totals(text)
    return {phase: totals[f"{phase}_s"] / totals[f"{phase}_n"] for phase, _, _ in PHASES
            if totals.get(f"{phase}_n")}


def route_counts(text: str) -> dict[str, float]:
    """Route decisions by kind, and fallbacks by reason (`fallback:<reason>`)."""
    counts: dict[str, float] = {}
    for line in text.splitlines():
        for metric, label, prefix in (("disagg_proxy_route_decisions_total{", "kind", ""),
                                      ("disagg_proxy_route_fallbacks_total{", "reason",
                                       "fallback:")):
            if line.startswith(metric):
                value = line.split(f'{label}="', 1)[1].split('"', 1)[0]
                counts[prefix + value] = float(line.rsplit(" ", 1)[1])
    return counts


def stack_doc(kind: str, stack: str, prefills: int, local_prefill_tokens: int = 0,
              decodes: int | None = None, model: str | None = None) -> dict[str, Any]:
    """The tiny `kind` example's DisaggServing set up as `stack` (see the module's doc), with
    `prefills` prefill instances (and `decodes`, `model` when given)."""
    import yaml

    doc: dict[str, Any] = yaml.safe_load(
        (ROOT / "examples" / f"tiny-{kind}-1p2d.yaml").read_text())
    spec_doc = doc["spec"]
    spec_doc.setdefault("prefill", {})["replicas"] = prefills
    if decodes is not None:
        spec_doc.setdefault("decode", {})["replicas"] = decodes
    if model is not None:
        spec_doc["model"]["name"] = spec_doc["model"]["servedModelName"] = model
    transfer = spec_doc.setdefault("kvTransfer", {})
    if stack == "reuse-off":
        transfer.setdefault("extraConfig", {})["store_lookup"] = False
        spec_doc.setdefault("proxy", {})["storeRouting"] = False
    elif stack == "vllm-builtin":
        transfer["implementation"] = "vllm"
    elif stack == "kvhelper-save":
        transfer["saveDecodeCache"] = True
    elif stack == "kvhelper-sync":
        transfer.setdefault("extraConfig", {})["save_async"] = False
    elif stack == "kvhelper-step-loads":
        transfer.setdefault("extraConfig", {})["load_async"] = False
    elif stack == "kvhelper-no-routing":
        spec_doc.setdefault("proxy", {})["storeRouting"] = False
    elif stack == "kvhelper-no-lookup":
        transfer.setdefault("extraConfig", {})["store_lookup"] = False
    elif stack == "kvhelper-lookup-async":
        transfer.setdefault("extraConfig", {})["lookup_load_async"] = True
    elif stack == "kvhelper-local":
        spec_doc.setdefault("proxy", {})["localPrefillTokens"] = local_prefill_tokens
    return doc


def run_stack(kind: str, stack: str, prefills: int, work: Replay, folder_root: Path,
              max_tokens: int, local_prefill_tokens: int = 0) -> Row:
    from disagg_devtools.local.cli import with_tiny_model
    from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
    from disagg_devtools.processes import free_port
    from disagg_operator.spec import parse_spec

    doc = stack_doc(kind, stack, prefills, local_prefill_tokens)
    folder = RunFolder(folder_root / f"{stack}-{prefills}p")
    spec = with_tiny_model(parse_spec(doc["spec"]), folder, sys.executable)
    served = spec.model.served_model_name or spec.model.name
    deployment = LocalDeployment(doc["metadata"]["name"], spec, folder, proxy_port=free_port(),
                                 echo=lambda _: None)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        instances = {role: [f"http://127.0.0.1:{i.spec.port}" for i in deployment.started
                            if i.spec.role == role and i.spec.port]
                     for role in ("prefill", "decode")}
        before = instance_counts(instances)
        outcome = asyncio.run(replay(url, served, work, max_tokens))
        # vLLM publishes its counters on its logging interval, not with each response.
        time.sleep(12)
        after = instance_counts(instances)
        proxy_text = scrape_text(url)
        for role, urls in instances.items():  # kept with the logs (--keep), for a closer look
            for i, instance_url in enumerate(urls):
                (folder.logs / f"{role}-{i}.metrics.txt").write_text(scrape_text(instance_url))
        routes, phases = route_counts(proxy_text), phase_means(proxy_text)
        store = store_usage(deployment, doc["metadata"]["name"])
        skipped_tail = 0.0
        if routes.get("skip_prefill"):
            # Requests that skipped prefill computed their tail on decode: prefill work.
            skipped_tail = scrape_proxy(url, "disagg_proxy_skip_prefill_computed_tokens_total")
    finally:
        stop_recorded(folder, lambda _: None)
    total = work.prompt_tokens
    return Row(f"{stack} {prefills}P2D", (after[0] - before[0] + skipped_tail) / total,
               (after[1] - before[1]) / total, outcome, routes, store, phases,
               after[2] - before[2])


def instance_counts(instances: dict[str, list[str]]) -> tuple[float, float, float]:
    """Prompt tokens computed by the prefill instances and by every instance, and blocks the
    prefill instances loaded from the store: one scrape of each instance."""
    pages = {url: scrape_text(url) for urls in instances.values() for url in urls}
    prefills = [pages[url] for url in instances["prefill"]]
    return (sum(map(computed_tokens, prefills)), sum(map(computed_tokens, pages.values())),
            sum(map(store_loaded_blocks, prefills)))


def store_usage(deployment: Any, name: str) -> tuple[float, float]:
    """Keys and bytes the Mooncake master says the store holds."""
    import re

    master = deployment.find(f"{name}-mooncake-master-0")
    port = re.search(r"--metrics_port=(\d+)", " ".join(master.spec.argv))
    if port is None:
        return (0.0, 0.0)
    text = scrape_text(f"http://127.0.0.1:{port.group(1)}")
    return (sum(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("master_key_count ")),
            sum(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("master_allocated_bytes ")))


def scrape_text(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        return response.read().decode()


def scrape_proxy(url: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in scrape_text(url).splitlines()
               if line.startswith((name + " ", name + "{")))


def run_monolithic(kind: str, work: Replay, folder_root: Path, max_tokens: int) -> Row:
    import yaml
    from disagg_devtools.local.cli import with_tiny_model
    from disagg_devtools.local.runner import RunFolder
    from disagg_operator.spec import parse_spec

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from local_1p2d import start_single

    doc = yaml.safe_load((ROOT / "examples" / f"tiny-{kind}-1p2d.yaml").read_text())
    spec = with_tiny_model(parse_spec(doc["spec"]), RunFolder(folder_root / "mono"),
                           sys.executable)
    served = spec.model.served_model_name or spec.model.name
    process, url = start_single(sys.executable, Path(spec.model.name), served,
                                list(spec.decode.extra_args), folder_root / "mono.log")
    try:
        before = scrape([url], computed_tokens)
        outcome = asyncio.run(replay(url, served, work, max_tokens))
        time.sleep(12)
        after = scrape([url], computed_tokens)
    finally:
        os.killpg(process.pid, 15)
        process.wait(30)
    share = (after - before) / work.prompt_tokens
    return Row("monolithic", share, share, outcome, {})


def phase_column(phases: dict[str, float]) -> str:
    return "/".join(f"{phases[p] * 1000:.0f}" if p in phases else "-" for p, _, _ in PHASES) \
        + " ms"


def medians(rows: list[Row], rounds: int) -> str:
    """Each stack's median over the rounds: computed share, TTFT p50 and p90, e2e p50."""
    by_stack: dict[str, list[Row]] = {}
    for row in rows:
        by_stack.setdefault(row.stack, []).append(row)
    lines = [f"median of {rounds} rounds (TTFT p50 of each round in brackets)",
             f"{'stack':<22}{'computed':>9}{'TTFT p50':>10}{'p90':>8}{'e2e p50':>9}  rounds"]
    for stack, group in by_stack.items():
        p50s = [statistics.median(r.outcome.ttft or [0]) * 1000 for r in group]
        p90 = statistics.median(percentile(r.outcome.ttft, 0.9) for r in group) * 1000
        e2e = statistics.median(statistics.median(r.outcome.e2e or [0]) for r in group) * 1000
        lines.append(f"{stack:<22}{statistics.median(r.computed_share for r in group):>9.3f}"
                     f"{statistics.median(p50s):>8.0f}ms{p90:>6.0f}ms{e2e:>7.0f}ms"
                     f"  [{' '.join(f'{p:.0f}' for p in p50s)}]")
    return "\n".join(lines)


def by_reuse(work: Replay, rows: list[Row]) -> str:
    """TTFT p50 of each stack (every round's requests together) by what an unbounded
    cluster-wide cache holds of the prompt: where reuse gains and where it costs."""
    classes = work.reuse_classes()
    names = ("whole", "part", "cold")
    counts = {name: classes.count(name) for name in names}
    lines = ["TTFT p50 by what the store could hold of the prompt: "
             + ", ".join(f"{name} {counts[name]}" for name in names),
             f"{'stack':<22}" + "".join(f"{name:>9}" for name in names)]
    by_stack: dict[str, list[Row]] = {}
    for row in rows:
        by_stack.setdefault(row.stack, []).append(row)
    for stack, group in by_stack.items():
        cells = []
        for name in names:
            values = [t for r in group for i, t in r.outcome.ttft_by_request.items()
                      if classes[i] == name]
            cells.append(f"{statistics.median(values) * 1000:>7.0f}ms" if values else
                         f"{'-':>9}")
        lines.append(f"{stack:<22}" + "".join(cells))
    return "\n".join(lines)


def report(kind: str, work: Replay, rows: list[Row]) -> str:
    ideal = work.ideal_computed() / work.prompt_tokens
    lines = [f"tiny {kind.upper()} model: {len(work.prompts)} requests, "
             f"{work.prompt_tokens} prompt tokens; ideal computed share {ideal:.3f} "
             f"({work.engine_block}-token engine blocks"
             + ("; MLA on vLLM's reference CPU backend: no prefix cache)"
                if kind == "mla" and reference_cpu_mla() else ")"),
             "timed: the ideal when a prompt reuses only what came back before it was sent",
             f"{'stack':<22}{'computed':>9}{'vs ideal':>9}{'timed':>7}{'all inst':>9}"
             f"{'TTFT p50':>10}{'p90':>8}{'e2e p50':>9}{'failed':>7}{'keys':>7}"
             f"{'MiB':>7}{'P loads':>8}{'lookup/prefill/decode':>23}  routes"]
    for row in rows:
        out = row.outcome
        lines.append(
            f"{row.stack:<22}{row.computed_share:>9.3f}{row.computed_share - ideal:>+9.3f}"
            f"{work.ideal_computed(out) / work.prompt_tokens:>7.3f}{row.all_share:>9.3f}"
            f"{statistics.median(out.ttft or [0]) * 1000:>8.0f}ms"
            f"{percentile(out.ttft, 0.9) * 1000:>6.0f}ms"
            f"{statistics.median(out.e2e or [0]) * 1000:>7.0f}ms{out.failed:>7}"
            f"{row.store[0]:>7.0f}{row.store[1] / 2**20:>7.1f}{row.prefill_loaded_blocks:>8.0f}"
            f"{phase_column(row.phases):>23}  "
            + " ".join(f"{k}={v:.0f}" for k, v in sorted(row.routes.items())))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=["mla", "gqa"], default="mla")
    parser.add_argument("--trace", type=Path, default=TRACE)
    parser.add_argument("--modulo", type=int, default=40)
    parser.add_argument("--limit", type=int, default=120, help="requests replayed")
    parser.add_argument("--max-blocks", type=int, default=24)
    parser.add_argument("--block-tokens", type=int, default=32)
    parser.add_argument("--speedup", type=float, default=60.0)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--prefills", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--stacks", nargs="+",
                        default=["kvhelper", "kvhelper-save", "reuse-off", "vllm-builtin",
                                 "monolithic"])
    parser.add_argument("--local-prefill-tokens", type=int, default=128,
                        help="proxy.localPrefillTokens of the kvhelper-local stack")
    parser.add_argument("--rounds", type=int, default=1,
                        help="replay every stack this many times, interleaved (the machine is "
                        "noisy), and end with each stack's median over the rounds")
    parser.add_argument("--engine-threads", type=int, default=1,
                        help="OpenMP threads per engine, unbound (0: vLLM's own binding)")
    parser.add_argument("--keep", type=Path, default=None,
                        help="keep each run's folder (logs of every process) under this folder")
    args = parser.parse_args()
    from disagg_devtools.processes import isolate_benchmark

    isolate_benchmark()  # stopped with kill: still stop what it started; own loopback
    from disagg_devtools.local.runner import share_cores

    share_cores(args.engine_threads)
    requests = sample(args.trace, args.modulo, args.max_blocks, args.limit)
    with contextlib.ExitStack() as cleanup:
        if args.keep is None:
            root = Path(cleanup.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-replay-")))
        else:
            root = args.keep.resolve()
            root.mkdir(parents=True, exist_ok=True)
        from disagg_devtools.tiny_models import VOCAB

        work = map_to_tokens(requests, args.block_tokens, VOCAB, args.speedup,
                             cache_block=engine_block_tokens(args.kind, args.block_tokens))
        rows = []
        for round_ in range(args.rounds):
            folder = root / f"round{round_ + 1}" if args.rounds > 1 else root
            for stack in args.stacks:
                if stack == "monolithic":
                    rows.append(run_monolithic(args.kind, work, folder, args.max_tokens))
                    continue
                for prefills in (args.prefills[:1] if stack == "kvhelper-save"
                                 else args.prefills):
                    rows.append(run_stack(args.kind, stack, prefills, work, folder,
                                          args.max_tokens, args.local_prefill_tokens))
                print(report(args.kind, work, rows), flush=True)
    print(report(args.kind, work, rows))
    if args.rounds > 1:
        print(medians(rows, args.rounds))
    print(by_reuse(work, [row for row in rows if row.outcome.ttft_by_request]))


if __name__ == "__main__":
    main()
