"""Benchmark: a chaos soak. A local 2P2D deployment of the tiny MLA model (float32; two proxies,
two Mooncake masters in HA mode, one store pod, etcd: every component of the operator's plan as
a local process) serves a steady load while, every `--interval` seconds, one component is
SIGKILLed or SIGSTOPped: a prefill or decode vLLM, a proxy, the leading master, etcd, the store
pod or a registrar. A killed process is started again after `--restart-delay` with its own
command line and ports, as the kubelet restarts a container; a stopped one is resumed after
`--stop-seconds`.

Every answer is checked by the exactness criterion (disagg_devtools.exactness) against one plain
vLLM instance that computed every prompt beforehand: greedy tokens and float32 logprobs. Per
fault type it prints the faults, the requests that overlapped them, the failed ones by phase,
the wrong ones, p99 latency, and the recovery time (from the fault until every process is back
and both proxies route to every instance again). Clients behave as the OpenAI client behind a
Service: a request whose proxy refuses or drops the connection before answering goes to the
other proxy; a stream under way at a proxy that is killed is lost with it (phase "proxy": no
proxy can save it).

    .venv-serving/bin/python benchmarks/chaos.py --seconds 600          # the soak
    .venv-serving/bin/python benchmarks/chaos.py --seconds 120 --interval 15 --seed 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from disagg_devtools.exactness import Conversations, compare
from disagg_devtools.local.cli import load as load_spec
from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
from disagg_devtools.processes import exit_on_sigterm, free_port
from disagg_devtools.tiny_models import make_mla

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ("prefill", "decode", "proxy", "master", "etcd", "store", "registrar")
ACTIONS = ("kill", "stop")
MAX_TOKENS = 8
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=180)


@dataclass
class Outcome:
    started: float
    ended: float
    ok: bool
    phase: str = ""  # where a failed request failed: proxy, prefill, decode, none-left
    wrong: bool = False
    detail: str = ""

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Fault:
    component: str
    action: str
    target: str  # the process hit
    at: float
    recovered: float | None = None

    @property
    def kind(self) -> str:
        return f"{self.action} {self.component}"


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)

    @property
    def wrong(self) -> int:
        return sum(o.wrong for o in self.outcomes)

    def failed(self, phase: str | None = None) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok and phase in (None, o.phase)]

    def during(self, fault: Fault) -> list[Outcome]:
        end = fault.recovered if fault.recovered is not None else fault.at + 60
        return [o for o in self.outcomes if o.ended >= fault.at and o.started <= end]

    def table(self) -> str:
        rows = [f"{'fault':18} {'count':>5} {'requests':>8} {'failed':>6} {'by phase':24} "
                f"{'wrong':>5} {'p99 s':>6} {'recovery s (median / max)':>26}"]
        kinds = sorted({f.kind for f in self.faults})
        for kind in [*kinds, "all (whole run)"]:
            faults = [f for f in self.faults if f.kind == kind]
            outcomes = (self.outcomes if kind.startswith("all") else
                        list({id(o): o for f in faults for o in self.during(f)}.values()))
            failed = [o for o in outcomes if not o.ok]
            phases: dict[str, int] = {}
            for o in failed:
                phases[o.phase] = phases.get(o.phase, 0) + 1
            recoveries = sorted(f.recovered - f.at for f in faults if f.recovered is not None)
            recovery = (f"{recoveries[len(recoveries) // 2]:.1f} / {recoveries[-1]:.1f}"
                        if recoveries else ("-" if kind.startswith("all") else "never"))
            rows.append(f"{kind:18} {len(faults) if faults else '':>5} {len(outcomes):8} "
                        f"{len(failed):6} {json.dumps(phases):24} "
                        f"{sum(o.wrong for o in outcomes):5} {p99(outcomes):6.2f} "
                        f"{recovery:>26}")
        return "\n".join(rows)


def p99(outcomes: Iterable[Outcome]) -> float:
    times = sorted(o.seconds for o in outcomes if o.ok)
    return times[min(len(times) - 1, int(len(times) * 0.99))] if times else 0.0


def soak_spec(model: Path) -> tuple[str, Any]:
    name, spec = load_spec(ROOT / "examples" / "tiny-mla-1p2d.yaml", str(model))
    return name, spec.model_copy(update={
        "model": spec.model.model_copy(update={"dtype": "float32"}),
        "prefill": spec.prefill.model_copy(update={"replicas": 2}),
        "decode": spec.decode.model_copy(update={"replicas": 2}),
        "proxy": spec.proxy.model_copy(update={"replicas": 2}),
        "mooncake_master": spec.mooncake_master.model_copy(update={
            "replicas": 2, "client_ttl_seconds": 5}),
        "store": spec.store.model_copy(update={"replicas": 1, "segment_size": "256Mi"})})


def prompts_for(seed: int, model: Path, count: int) -> list[list[int]]:
    """Conversation-like prompts sharing system prompts and histories, as token ids."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    talk = Conversations(seed, conversations=max(2, count // 3))
    texts = []
    for turn in range(3):
        for conversation in range(talk.conversations):
            texts.append(talk.prompt(conversation, f"answer {turn}" if turn else None))
    return [tokenizer(t)["input_ids"] for t in texts[:count]]


def reference(model: Path, prompts: list[list[int]]) -> list[list[list[list[float]]]]:
    """Each prompt's top two per step from one plain vLLM instance, computed whole."""
    request = {"model": str(model), "dtype": "float32", "max_model_len": 1024,
               "prompts": prompts, "max_tokens": MAX_TOKENS, "top": 2}
    done = subprocess.run([sys.executable, "-m", "disagg_devtools.local.single_instance",
                           json.dumps(request)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DISAGG_VLLM_CPU_KERNELS": "vector"})
    if done.returncode != 0:
        raise RuntimeError(f"the plain instance failed: {done.stderr[-2000:]}")
    return list(json.loads(done.stdout.strip().splitlines()[-1])["top"])


async def ask(session: aiohttp.ClientSession, proxies: list[str], first: int, model: str,
              prompt: list[int]) -> tuple[list[int], list[float], str, str]:
    """One streamed greedy answer; (tokens, logprobs, failed phase, detail). A request whose
    proxy refused or dropped the connection before answering goes to the other proxy, as the
    OpenAI client retries connection errors and a Service leaves a dead endpoint."""
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "stream": True, "logprobs": 1, "return_token_ids": True}
    tokens: list[int] = []
    logprobs: list[float] = []
    detail = "no proxy"
    for attempt in range(2 * len(proxies)):
        url = proxies[(first + attempt) % len(proxies)]
        try:
            response = await session.post(f"{url}/v1/completions", json=body,
                                          timeout=REQUEST_TIMEOUT)
        except (aiohttp.ClientConnectionError, TimeoutError) as err:
            detail = f"{url}: {err!r}"[:200]
            continue  # no answer began: the other proxy takes it
        try:
            if response.status != 200:
                text = await response.text()
                return tokens, logprobs, _phase(text), f"{response.status} {text[:200]}"
            done = False
            async for line in response.content:
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif line.startswith(b"data: "):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        message = json.dumps(chunk["error"])
                        return tokens, logprobs, _phase(message), message[:200]
                    choice = chunk["choices"][0]
                    tokens += choice.get("token_ids") or []
                    logprobs += (choice.get("logprobs") or {}).get("token_logprobs") or []
            return tokens, logprobs, "" if done else "proxy", "" if done else "no [DONE]"
        except (aiohttp.ClientError, TimeoutError) as err:
            return tokens, logprobs, "proxy", f"{url}: {err!r}"[:200]
        finally:
            response.release()
    return tokens, logprobs, "proxy", detail


def signal_group(pid: int, sig: signal.Signals) -> None:
    """A signal to a process's group (the local runner starts each in a group of its own)."""
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _phase(message: str) -> str:
    if "no healthy" in message:
        return "none-left"
    for phase in ("prefill", "decode"):
        if phase in message:
            return phase
    return "proxy"


class Chaos:
    def __init__(self, deployment: LocalDeployment, name: str, proxies: list[str],
                 rng: random.Random, args: argparse.Namespace) -> None:
        self.deployment, self.name, self.proxies, self.rng = deployment, name, proxies, rng
        self.args = args
        self.expected_instances = 4  # 2 prefill, 2 decode
        self.faults: list[Fault] = []
        self.busy = False  # a fault is under way: the load goes on until it has recovered

    def processes(self, component: str) -> list[str]:
        role = {"master": "mooncake-master", "store": "store"}.get(component, component)
        names = [i.spec.name for i in self.deployment.started]
        if component == "registrar":
            return [n for n in names if n.endswith("-registrar")]
        return [n for n in names if n.startswith(f"{self.name}-{role}-")
                and not n.endswith("-registrar")]

    async def inject(self, component: str, action: str) -> Fault:
        """Hit one process of `component`, bring it back as the kubelet would, and wait until
        the deployment is whole again."""
        if component == "etcd":
            assert self.deployment.etcd is not None and self.deployment.etcd.process is not None
            target, pid = "etcd", self.deployment.etcd.process.pid
        else:
            choices = self.processes(component)
            if component == "master":  # the leader: a standby's loss changes nothing
                choices = [n for n in choices if self.master_role(n) == "leader"] or choices
            target = self.rng.choice(choices)
            pid = self.deployment.find(target).process.pid
        fault = Fault(component, action, target, time.monotonic())
        self.faults.append(fault)  # listed from the start: the run may end before recovery
        print(f"  {time.strftime('%H:%M:%S')} {action} {target}", flush=True)
        signal_group(pid, signal.SIGKILL if action == "kill" else signal.SIGSTOP)
        if action == "stop":
            await asyncio.sleep(self.args.stop_seconds)
            signal_group(pid, signal.SIGCONT)
        else:
            await asyncio.sleep(self.args.restart_delay)
            if component == "etcd":
                await self.deployment.restart_etcd()
            else:
                await self.deployment.restart(target, timeout=300)
        await self.wait_whole(fault)
        return fault

    def master_role(self, name: str) -> str:
        """A master's role from its admin port's /health (leader, standby), "" if unknown."""
        argv = " ".join(self.deployment.find(name).spec.argv)
        port = re.search(r"--metrics_port=(\d+)", argv)
        if port is None:
            return ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/health",
                                        timeout=2) as response:
                return str(json.loads(response.read()).get("role", ""))
        except (OSError, ValueError):
            return ""

    async def wait_whole(self, fault: Fault) -> None:
        """Recovered: both proxies route to every instance, healthy."""
        deadline = time.monotonic() + 300
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                counts = []
                for url in self.proxies:
                    try:
                        async with session.get(f"{url}/instances",
                                               timeout=aiohttp.ClientTimeout(total=2)) as r:
                            counts.append(sum(i["healthy"] for i in await r.json()))
                    except (aiohttp.ClientError, TimeoutError, ValueError):
                        counts.append(0)
                if all(c >= self.expected_instances for c in counts):
                    fault.recovered = time.monotonic()
                    print(f"    recovered after {fault.recovered - fault.at:.1f} s", flush=True)
                    return
                await asyncio.sleep(0.5)
        print(f"    not recovered within 300 s of {fault.kind}", flush=True)


async def soak(deployment: LocalDeployment, name: str, proxies: list[str],
               prompts: list[list[int]], top: list[list[list[list[float]]]],
               args: argparse.Namespace, plan: list[tuple[str, str]] | None = None) -> Report:
    report = Report()
    rng = random.Random(args.seed)
    chaos = Chaos(deployment, name, proxies, rng, args)
    stop_at = time.monotonic() + args.seconds
    counter = iter(range(10**9))

    report.faults = chaos.faults
    hard_stop = stop_at + 300  # a fault under way at the end is given this long to recover

    def going_on() -> bool:
        now = time.monotonic()
        return (now < stop_at or (chaos.busy and now < hard_stop)) \
            and len(report.outcomes) < args.max_requests

    async def client(session: aiohttp.ClientSession) -> None:
        while going_on():
            n = next(counter)
            started = time.monotonic()
            tokens, logprobs, phase, detail = await ask(session, proxies, n, name,
                                                        prompts[n % len(prompts)])
            outcome = Outcome(started, time.monotonic(), not phase, phase, detail=detail)
            if outcome.ok:
                gap = compare(n % len(prompts), tokens, logprobs, top[n % len(prompts)])
                # (an answer may end before MAX_TOKENS: the plain instance's ended there too)
                outcome.wrong = not gap.exact or len(tokens) != len(top[n % len(prompts)])
                if outcome.wrong:
                    outcome.detail = f"{gap}"
                    print(f"    WRONG: prompt {n % len(prompts)}: {gap}", flush=True)
            elif args.verbose:
                print(f"    failed ({phase}): {detail}", flush=True)
            report.outcomes.append(outcome)

    async def faults() -> None:
        """Random faults until the end, or each fault of `plan` once, in order."""
        steps = iter(plan) if plan else None
        while True:
            await asyncio.sleep(rng.uniform(*args.interval))
            if time.monotonic() > stop_at - 5:
                return
            if steps is None:
                component, action = rng.choice(COMPONENTS), rng.choice(ACTIONS)
            elif (step := next(steps, None)) is None:
                return
            else:
                component, action = step
            chaos.busy = True
            try:
                await chaos.inject(component, action)
            finally:
                chaos.busy = False

    async with aiohttp.ClientSession() as session:
        load = [asyncio.create_task(client(session)) for _ in range(args.clients)]
        injector = asyncio.create_task(faults())
        await asyncio.gather(*load)
        injector.cancel()
        await asyncio.gather(injector, return_exceptions=True)
    return report


def run(args: argparse.Namespace, plan: list[tuple[str, str]] | None = None,
        work: Path | None = None) -> Report:
    """Start the deployment, soak it, stop it; the report."""
    work = work or Path(tempfile.mkdtemp(prefix="chaos-"))
    model = args.model or make_mla(work / "model")
    name, spec = soak_spec(model)
    prompts = prompts_for(args.seed, model, args.prompts)
    print(f"reference: one plain vLLM instance computes {len(prompts)} prompts", flush=True)
    top = reference(model, prompts)
    folder = RunFolder(work / "run")
    deployment = LocalDeployment(name, spec, folder, python=sys.executable,
                                 proxy_port=free_port(), echo=print,
                                 extra_env={"DISAGG_VLLM_CPU_KERNELS": "vector"})
    try:
        first = asyncio.run(deployment.up(timeout=900))
        proxies = [first] + [f"http://127.0.0.1:{i.spec.port}" for i in deployment.started
                             if i.spec.role == "proxy" and i.spec.port
                             and f":{i.spec.port}" not in first]
        print(f"serving through {proxies}; soaking {args.seconds:g} s", flush=True)
        return asyncio.run(soak(deployment, name, proxies, prompts, top, args, plan))
    finally:
        stop_recorded(folder, print)


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600.0, help="how long the load runs")
    parser.add_argument("--interval", type=float, nargs=2, default=(30.0, 60.0),
                        metavar=("MIN", "MAX"), help="seconds between one fault's recovery "
                        "and the next fault, drawn uniformly")
    parser.add_argument("--restart-delay", type=float, default=2.0,
                        help="seconds before a killed process is started again")
    parser.add_argument("--stop-seconds", type=float, default=8.0,
                        help="how long a stopped process stays stopped")
    parser.add_argument("--clients", type=int, default=2, help="requests in flight")
    parser.add_argument("--prompts", type=int, default=18)
    parser.add_argument("--max-requests", type=int, default=20000, help="a bound on the load")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--model", type=Path, help="the tiny MLA model (default: made anew)")
    parser.add_argument("--verbose", action="store_true", help="print every failure")
    return parser


def main() -> None:
    args = parser().parse_args()
    exit_on_sigterm()  # stopped with kill: still stop what it started
    if args.seed is None:
        args.seed = random.randrange(1 << 31)
    print(f"chaos soak: seed {args.seed}, {args.seconds:g} s, a fault every "
          f"{args.interval[0]:g} to {args.interval[1]:g} s after the last recovered", flush=True)
    report = run(args)
    print(report.table())
    lost = report.failed("proxy")
    print(f"requests {len(report.outcomes)}, failed {len(report.failed())} (of which "
          f"{len(lost)} with a proxy that was killed or stopped under them), "
          f"wrong {report.wrong}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
