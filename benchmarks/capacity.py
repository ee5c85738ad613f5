"""Capacity at latency targets: the highest request rate each stack serves with TTFT p90 and
ITL p90 within targets, on the conversation sample of the Mooncake trace (trace_replay's
mapping), with the compute-sized random-weight model (`tiny_models --size compute`: prefill,
not the hops, dominates). Every stack gets the same two engines, one OpenMP thread each:

- `kvhelper`: 1 prefill + 1 decode, kvhelper's connector with store lookups and the proxy's
  store-aware routing;
- `vllm-builtin`: 1 prefill + 1 decode, vLLM's built-in MooncakeStoreConnector, round-robin;
- `reuse-off`: 1 prefill + 1 decode, kvhelper without store lookups or store routing;
- `monolithic`: two ordinary vLLM instances, each with its own prefix cache, behind a
  prefix-aware router (`PrefixAffinityRouter`: a prompt goes where its longest prefix was
  served, else to the less busy instance), what a user would run instead of P/D.

The targets come from the model's single-request latencies, measured first on one idle
instance: TTFT target = `--slo-factor` x the TTFT of a cold prompt of the sample's p90 length,
ITL target = `--slo-factor` x the gap between tokens of one lone stream.

Each rate replays the sample's `--requests` first requests with their trace spacing scaled to
that mean rate, tokens mapped with a seed of its own (nothing is reused across rates). A stack
whose p90s exceed the targets `--give-up` times is not run at higher rates. A stack's capacity
is where max(TTFT p90 / target, ITL p90 / target) crosses 1, interpolated between the rates
that bracket it; a stack that never crosses is reported as at least the highest rate.

    .venv-serving/bin/python benchmarks/capacity.py --kind gqa --plot capacity-gqa.png

Bounded: a fixed number of requests per rate, each with a timeout. As root it runs in a
private network namespace.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trace_replay import (  # noqa: E402  (a script beside this one)
    PHASES,
    TRACE,
    Replay,
    engine_block_tokens,
    map_to_tokens,
    percentile,
    phase_totals,
    route_counts,
    sample,
    scrape_text,
    stack_doc,
    tokens_by_source,
)

STACKS = ("kvhelper", "vllm-builtin", "reuse-off", "monolithic")
# trace_replay's variants of kvhelper, for finding where a difference comes from.
VARIANTS = ("kvhelper-no-routing", "kvhelper-no-lookup", "kvhelper-local", "kvhelper-sync",
            "kvhelper-step-loads", "kvhelper-lookup-async", "kvhelper-save")
TIMEOUT = aiohttp.ClientTimeout(total=300)
SEGMENT = "1Gi"  # each engine's share of the store: every rate's prompts fit


@dataclass
class Timing:
    """One request: when it was sent (seconds from the rate's start), its TTFT and the gaps
    between its streamed tokens; `ttft` None: it failed."""
    sent: float
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    error: str = ""  # why it failed


@dataclass(frozen=True)
class Targets:
    ttft_s: float
    itl_s: float
    basis: str  # what they were derived from

    def line(self) -> str:
        return (f"targets: TTFT p90 <= {self.ttft_s * 1000:.0f} ms, ITL p90 <= "
                f"{self.itl_s * 1000:.1f} ms ({self.basis})")

    def met_by(self, timing: Timing) -> bool:
        return (timing.ttft is not None and timing.ttft <= self.ttft_s
                and percentile(timing.gaps, 0.9) <= self.itl_s)


@dataclass(frozen=True)
class Point:
    """One stack at one rate."""
    stack: str
    rate: float
    timings: tuple[Timing, ...]
    seconds: float  # from the first request sent to the last answer
    # What the stack counted during this rate (P/D only): the proxy's route decisions and
    # phase times, or with --prefill-only the prefill engine's computed and loaded tokens.
    counters: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(t.ttft is None for t in self.timings)

    def ttft(self, q: float) -> float:
        return percentile([t.ttft for t in self.timings if t.ttft is not None], q)

    def itl(self, q: float) -> float:
        return percentile([g for t in self.timings for g in t.gaps], q)

    def within(self, targets: Targets) -> float:
        """The share of requests with TTFT and their own ITL p90 both within the targets."""
        return sum(map(targets.met_by, self.timings)) / len(self.timings)

    def slack(self, targets: Targets) -> float:
        """The worse of TTFT p90 and ITL p90 over its target; above 1 misses the targets."""
        if self.failed:
            return math.inf
        return max(self.ttft(0.9) / targets.ttft_s, self.itl(0.9) / targets.itl_s)


def capacity(points: list[Point], targets: Targets) -> tuple[float, bool]:
    """(rate, exact): where the slack crosses 1, interpolated between the bracketing rates (the
    last rate met, when the next one failed a request); exact False: the stack met the targets
    at every rate run (a lower bound), or at none (0)."""
    ordered = sorted(points, key=lambda p: p.rate)
    best = 0.0
    for low, high in zip([None, *ordered], ordered, strict=False):
        if high.slack(targets) <= 1:
            best = high.rate
            continue
        if low is None:
            return 0.0, False
        low_slack, high_slack = low.slack(targets), high.slack(targets)
        if math.isinf(high_slack):  # a failed request: no latency to interpolate on
            return low.rate, True
        return low.rate + (high.rate - low.rate) * (1 - low_slack) / (high_slack - low_slack), True
    return best, False


class PrefixAffinityRouter:
    """Picks the instance that served the prompt's longest block-aligned prefix (its prefix
    cache may hold it), unless that one has `balance` more requests in progress than the
    other; else the least busy. What cache-aware routers in front of monolithic instances do
    (SGLang's router, vLLM production-stack's prefix-aware routing), made in the load
    generator: no hop, which favours this stack by a proxy's forwarding (about 1 ms)."""

    def __init__(self, urls: list[str], block: int, balance: int = 4) -> None:
        self.urls, self.block, self.balance = urls, block, balance
        self.busy = dict.fromkeys(urls, 0)
        self.served: dict[bytes, str] = {}

    def _prefixes(self, prompt: list[int]) -> list[bytes]:
        digest, found = hashlib.sha256(), []
        for start in range(0, len(prompt) - self.block + 1, self.block):
            digest.update(repr(prompt[start:start + self.block]).encode())
            found.append(digest.copy().digest())
        return found

    @contextlib.contextmanager
    def route(self, prompt: list[int]) -> Iterator[str]:
        prefixes = self._prefixes(prompt)
        idle = min(self.urls, key=self.busy.__getitem__)
        url = next((self.served[p] for p in reversed(prefixes) if p in self.served), idle)
        if self.busy[url] - self.busy[idle] > self.balance:
            url = idle
        for prefix in prefixes:
            self.served[prefix] = url
        self.busy[url] += 1
        try:
            yield url
        finally:
            self.busy[url] -= 1


@contextlib.contextmanager
def one_url(url: str) -> Iterator[str]:
    yield url


Route = Callable[[list[int]], contextlib.AbstractContextManager[str]]


async def stream(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                 max_tokens: int, timing: Timing, began: float) -> None:
    """One streamed request; its timing is filled in only if every token came back. An event
    may carry more than one token (vLLM holds back text that ends inside a UTF-8 character),
    so the count comes from the stream's usage."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    marks: list[float] = []
    generated = 0
    try:
        async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as answer:
            if answer.status != 200:
                timing.error = f"HTTP {answer.status}: {(await answer.text())[:200]}"
                return
            async for raw in answer.content:
                if not raw.startswith(b"data: {"):
                    continue
                event = json.loads(raw[len(b"data: "):])
                if "error" in event:
                    timing.error = f"error event: {str(event['error'])[:200]}"
                    return
                if event.get("choices"):
                    marks.append(time.perf_counter() - began)
                if event.get("usage"):
                    generated = event["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError) as err:
        timing.error = f"{type(err).__name__}: {err}"
        return
    if not marks or generated != max_tokens:  # a stream cut short is a failed request
        timing.error = f"{generated} of {max_tokens} tokens in {len(marks)} events"
        return
    timing.ttft = marks[0] - timing.sent
    timing.gaps = [b - a for a, b in zip(marks, marks[1:], strict=False)]


async def replay_at(route: Route, model: str, prompts: list[list[int]],
                    arrivals: list[float], max_tokens: int) -> tuple[list[Timing], float]:
    """Send each prompt at its arrival (open loop); the timings and the seconds it took."""
    began = time.perf_counter()
    timings = [Timing(sent=at) for at in arrivals]

    async def one(session: aiohttp.ClientSession, prompt: list[int], timing: Timing) -> None:
        await asyncio.sleep(max(0.0, timing.sent - (time.perf_counter() - began)))
        timing.sent = time.perf_counter() - began
        with route(prompt) as url:
            await stream(session, url, model, prompt, max_tokens, timing, began)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(one(session, p, t) for p, t in zip(prompts, timings,
                                                                   strict=True)))
    return timings, time.perf_counter() - began


def at_rate(work: Replay, rate: float) -> list[float]:
    """The replay's arrivals, spaced as in the trace, scaled to `rate` requests per second."""
    span = work.arrivals[-1] - work.arrivals[0]
    if span <= 0:
        return [i / rate for i in range(len(work.arrivals))]
    scale = (len(work.arrivals) - 1) / rate / span
    return [(at - work.arrivals[0]) * scale for at in work.arrivals]


def measure_targets(url: str, model: str, length: int, vocab: int, max_tokens: int,
                    factor: float) -> Targets:
    """`factor` x one idle instance's latencies: TTFT of cold prompts of `length` tokens
    (the median of 8, after one to warm up), the median gap between tokens of those streams."""
    rng = random.Random(12345)
    ttfts, gaps = [], []

    async def measure() -> None:
        async with aiohttp.ClientSession() as session:
            for _ in range(9):
                timing = Timing(sent=0.0)
                began = time.perf_counter()
                prompt = [rng.randrange(10, vocab) for _ in range(length)]
                await stream(session, url, model, prompt, max_tokens, timing, began)
                if timing.ttft is None:
                    raise SystemExit(f"the targets' measurement failed at {url}")
                ttfts.append(timing.ttft)
                gaps.extend(timing.gaps)

    asyncio.run(measure())
    ttft, itl = statistics.median(ttfts[1:]), statistics.median(gaps)  # the first warms up
    return Targets(factor * ttft, factor * itl,
                   f"{factor:g} x one idle instance's TTFT of a cold {length}-token prompt "
                   f"({ttft * 1000:.0f} ms) and its gap between tokens ({itl * 1000:.1f} ms)")


@dataclass
class Sweep:
    """What the benchmark runs: the requests of each rate and how to run them."""
    kind: str
    model_dir: Path
    served: str
    works: dict[float, Replay]  # by rate
    max_tokens: int
    give_up: float
    targets: Targets | None = None
    echo: Callable[[str], None] = print
    prefill_only: bool = False  # P/D stacks: straight to the prefill instance, 1 token each

    def run(self, stack: str, route: Route,
            counters: Callable[[], dict[str, float]] = dict) -> list[Point]:
        """Every rate in turn; `counters`: the stack's cumulative counters, read after each."""
        assert self.targets is not None
        points = []
        before = counters()
        for rate, work in self.works.items():
            timings, seconds = asyncio.run(replay_at(route, self.served, work.prompts,
                                                     at_rate(work, rate), self.max_tokens))
            after = counters()
            point = Point(stack, rate, tuple(timings), seconds,
                          {k: v - before.get(k, 0.0) for k, v in after.items()
                           if v - before.get(k, 0.0)})
            before = after
            points.append(point)
            self.echo(row(point, self.targets))
            for timing in point.timings:
                if timing.error:
                    self.echo(f"  failed request: {timing.error}")
            if point.slack(self.targets) > self.give_up:
                break
        return points


def proxy_counters(text: str) -> dict[str, float]:
    """The proxy's route decisions, and each phase's seconds (`lookup`, `prefill`, `decode` to
    its first byte) as sum and count (`PHASE_s`, `PHASE_n`)."""
    return route_counts(text) | phase_totals(text)


def engine_sources(url: str) -> dict[str, float]:
    """Prompt tokens an engine computed and loaded (`computed`, `loaded`), once vLLM has
    published them (on its 10-second logging interval)."""
    time.sleep(11)
    found = tokens_by_source(scrape_text(url))
    return {name: found[source] for source, name in (("local_compute", "computed"),
                                                     ("external_kv_transfer", "loaded"))
            if source in found}


def phase_text(counters: dict[str, float]) -> str:
    """Mean ms per phase, then the route decisions."""
    means = [f"{phase}={counters[phase + '_s'] / counters[phase + '_n'] * 1000:.0f}ms"
             for phase, _, _ in PHASES if counters.get(phase + "_n")]
    routes = [f"{k}={v:.0f}" for k, v in sorted(counters.items())
              if not k.endswith(("_s", "_n"))]
    return " ".join(means + routes)


def run_disaggregated(sweep: Sweep, stack: str, folder_root: Path) -> list[Point]:
    from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
    from disagg_devtools.processes import free_port
    from disagg_operator.spec import parse_spec

    doc = stack_doc(sweep.kind, stack, prefills=1, decodes=1, model=str(sweep.model_dir))
    doc["spec"]["model"]["servedModelName"] = sweep.served
    doc["spec"]["kvTransfer"]["mooncake"]["globalSegmentSize"] = SEGMENT
    folder = RunFolder(folder_root / stack)
    deployment = LocalDeployment(doc["metadata"]["name"], parse_spec(doc["spec"]), folder,
                                 proxy_port=free_port(), echo=lambda _: None)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        if sweep.prefill_only:
            prefill = next(f"http://127.0.0.1:{i.spec.port}" for i in deployment.started
                           if i.spec.role == "prefill" and i.spec.port)
            return sweep.run(stack, lambda _: one_url(prefill),
                             lambda: engine_sources(prefill))
        return sweep.run(stack, lambda _: one_url(url), lambda: proxy_counters(scrape_text(url)))
    finally:
        stop_recorded(folder, lambda _: None)


@contextlib.contextmanager
def monolithic_instances(sweep: Sweep, count: int, folder_root: Path) -> Iterator[list[str]]:
    from local_1p2d import start_single

    doc = stack_doc(sweep.kind, "monolithic", prefills=1)
    folder_root.mkdir(parents=True, exist_ok=True)
    started = []
    try:
        for index in range(count):
            started.append(start_single(sys.executable, sweep.model_dir, sweep.served,
                                        list(doc["spec"]["decode"].get("extraArgs", [])),
                                        folder_root / f"monolithic-{index}.log"))
        yield [url for _, url in started]
    finally:
        for process, _ in started:
            os.killpg(process.pid, 15)
            process.wait(30)


def row(point: Point, targets: Targets) -> str:
    slack = point.slack(targets)
    return (f"{point.stack:<14}{point.rate:>6.2f}{len(point.timings):>6}{point.failed:>7}"
            f"{point.ttft(0.5) * 1000:>8.0f}{point.ttft(0.9) * 1000:>8.0f}"
            f"{point.itl(0.5) * 1000:>7.1f}{point.itl(0.9) * 1000:>7.1f}"
            f"{point.within(targets) * 100:>8.0f}%{slack:>7.2f}{point.seconds:>7.0f}s  "
            + phase_text(point.counters))


HEADER = (f"{'stack':<14}{'rate':>6}{'req':>6}{'failed':>7}{'TTFT50':>8}{'TTFT90':>8}"
          f"{'ITL50':>7}{'ITL90':>7}{'within':>9}{'slack':>7}{'took':>8}  counted")


def report(points: list[Point], targets: Targets) -> str:
    by_stack: dict[str, list[Point]] = {}
    for point in points:
        by_stack.setdefault(point.stack, []).append(point)
    found = {stack: capacity(group, targets) for stack, group in by_stack.items()}
    lines = [targets.line(),
             "ms; within: requests with TTFT and their own ITL p90 within both targets; "
             "slack: the worse p90 over its target", HEADER,
             *(row(p, targets) for p in points), "",
             f"{'stack':<14}{'capacity (req/s)':>18}  vs reuse-off  vs vllm-builtin"]
    for stack, (rate, exact) in found.items():
        text = f"{rate:.2f}" if exact else (f">= {rate:.2f}" if rate else "< lowest rate")
        ratios = []
        for base in ("reuse-off", "vllm-builtin"):
            base_rate, base_exact = found.get(base, (0.0, False))
            # A bound against a bound says nothing: only crossings are compared.
            comparable = base_rate and rate and (exact or base_exact)
            ratios.append(f"{rate / base_rate:>8.2f}x" if comparable else f"{'-':>9}")
        lines.append(f"{stack:<14}{text:>18}  {ratios[0]:>11}  {ratios[1]:>14}")
    return "\n".join(lines)


def plot(points: list[Point], targets: Targets, title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=120)
    by_stack: dict[str, list[Point]] = {}
    for point in points:
        by_stack.setdefault(point.stack, []).append(point)
    for stack, group in by_stack.items():
        group.sort(key=lambda p: p.rate)
        axes.plot([p.rate for p in group], [p.within(targets) * 100 for p in group],
                  marker="o", label=stack)
    axes.set_xlabel("request rate (requests/s)")
    axes.set_ylabel("requests within both targets (%)")
    axes.set_ylim(0, 105)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(out)
    plt.close(figure)


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(description=__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    add = cli.add_argument
    add("--kind", choices=["mla", "gqa"], default="gqa")
    add("--stacks", nargs="+", choices=STACKS + VARIANTS, default=list(STACKS))
    add("--rates", type=float, nargs="+", default=[0.5, 1, 1.5, 2, 3, 4])
    add("--requests", type=int, default=48, help="requests per rate")
    add("--trace", type=Path, default=TRACE)
    add("--modulo", type=int, default=40)
    add("--max-blocks", type=int, default=24)
    add("--block-tokens", type=int, default=32)
    add("--max-tokens", type=int, default=32)
    add("--slo-factor", type=float, default=3.0)
    add("--give-up", type=float, default=2.5,
        help="stop a stack's sweep once its slack exceeds this")
    add("--prefill-only", action="store_true",
        help="send each P/D stack's requests straight to its prefill instance, 1 token each "
        "(what reuse does to prefill alone; ITL is not measured), with the tokens it computed "
        "and loaded per rate")
    add("--plot", type=Path, default=None, help="write the PNG plot here")
    add("--keep", type=Path, default=None,
        help="keep each stack's folder (logs) under this folder")
    return cli


@dataclass(frozen=True)
class Result:
    points: list[Point]
    targets: Targets

    def capacity(self, stack: str) -> tuple[float, bool]:
        return capacity([p for p in self.points if p.stack == stack], self.targets)


def run(args: argparse.Namespace, echo: Callable[[str], None] = print) -> Result:
    """The sweep; call it in a private network namespace (main() makes one)."""
    from disagg_devtools.local.runner import share_cores
    from disagg_devtools.tiny_models import VOCAB, make_gqa, make_mla

    share_cores(1)
    requests = sample(args.trace, args.modulo, args.max_blocks, args.requests)
    cache_block = engine_block_tokens(args.kind, args.block_tokens)
    works = {rate: map_to_tokens(requests, args.block_tokens, VOCAB, 1.0, seed=index + 1,
                                 cache_block=cache_block)
             for index, rate in enumerate(sorted(args.rates))}
    first = next(iter(works.values()))
    p90_length = int(percentile([float(len(p)) for p in first.prompts], 0.9))
    points: list[Point] = []
    with contextlib.ExitStack() as cleanup:
        if args.keep is None:
            root = Path(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="capacity-")))
        else:
            root = args.keep.resolve()
            root.mkdir(parents=True, exist_ok=True)
        model_dir = root / f"tiny-{args.kind}-compute"
        (make_gqa if args.kind == "gqa" else make_mla)(model_dir, size="compute")
        sweep = Sweep(args.kind, model_dir, f"tiny-{args.kind}", works,
                      1 if args.prefill_only else args.max_tokens, args.give_up, echo=echo,
                      prefill_only=args.prefill_only)
        echo(f"{args.kind.upper()} compute model, {len(requests)} requests per rate "
             f"({first.prompt_tokens} prompt tokens, p90 prompt {p90_length} tokens, "
             f"{args.max_tokens} generated), ideal computed share "
             f"{first.ideal_computed() / first.prompt_tokens:.3f}")
        with monolithic_instances(sweep, 2 if "monolithic" in args.stacks else 1,
                                  root / "monolithic") as urls:
            targets = measure_targets(urls[0], sweep.served, p90_length, VOCAB,
                                      args.max_tokens, args.slo_factor)
            sweep.targets = targets
            echo(targets.line())
            echo(HEADER)
            if "monolithic" in args.stacks:
                router = PrefixAffinityRouter(urls, cache_block)
                points += sweep.run("monolithic", router.route)
        for stack in args.stacks:
            if stack != "monolithic":
                points += run_disaggregated(sweep, stack, root)
    result = Result(points, targets)
    echo(report(points, targets))
    if args.plot:
        plot(points, targets, f"{args.kind.upper()} compute model, 2 engines per stack, "
             f"{len(requests)} requests per rate", args.plot)
        echo(f"plot: {args.plot}")
    return result


def main() -> None:
    from disagg_devtools.processes import isolate_benchmark

    isolate_benchmark()
    run(parser().parse_args(), echo=lambda line: print(line, flush=True))


if __name__ == "__main__":
    main()
