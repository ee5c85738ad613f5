"""The Mooncake master in HA mode (spec.mooncakeMaster.replicas: 2): a local 1P2D deployment
(real vLLM, Mooncake masters electing a leader through the DisaggServing's etcd, proxy)
under a steady stream of requests loses its leading master to SIGKILL. The standby takes
over; the objects the old leader knew are gone, so their pages are recomputed. No output
may be wrong: each is the tokens the deployment gave before the kill (pages loaded) or a
single instance's from scratch (pages recomputed). Failed requests and the time to a serving
leader are measured and printed.

The stream is one request at a time: vLLM's CPU MLA path gives the tiny random model other
greedy tokens when requests share a batch (measured: a single plain vLLM instance, no
connector, differs on all 6 of these prompts between batched and one at a time), so only
unbatched outputs can be compared token for token."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import sys
import time
import urllib.request
from pathlib import Path

import aiohttp
import pytest
from disagg_devtools.local.cli import load
from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
from disagg_devtools.processes import free_port
from disagg_devtools.waiting import wait_for

from .conftest import in_private_network
from .engines import run_engine
from .streamed import Completion, complete

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [" ".join(f"request {i} part {j} asks the elected master" for j in range(8))
           for i in range(6)]
MAX_REQUESTS = 300  # bounded: the load stops after recovery or at this count
MAX_TOKENS = 8


def masters(deployment: LocalDeployment, name: str) -> dict[str, str]:
    """Each master process -> its admin address (the metrics port serves /health, /role)."""
    found = {}
    for item in deployment.started:
        if item.spec.name.startswith(f"{name}-mooncake-master-"):
            port = re.search(r"--metrics_port=(\d+)", " ".join(item.spec.argv))
            assert port is not None
            found[item.spec.name] = f"http://127.0.0.1:{port.group(1)}"
    return found


def health(admin: str) -> dict[str, object]:
    try:
        with urllib.request.urlopen(f"{admin}/health", timeout=2) as response:
            data: dict[str, object] = json.loads(response.read())
            return data
    except OSError:
        return {}


def test_killing_the_leading_master_under_load_gives_no_wrong_output(tiny_models,
                                                                     tmp_path) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    name, spec = load(ROOT / "examples" / "tiny-mla-1p2d.yaml", str(tiny_models["mla"]))
    spec = spec.model_copy(update={"mooncake_master": spec.mooncake_master.model_copy(
        update={"replicas": 2, "client_ttl_seconds": 5})})
    folder = RunFolder(tmp_path / "run")
    deployment = LocalDeployment(name, spec, folder, python=sys.executable,
                                 proxy_port=free_port(), echo=print)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        expected, results, killed_at, serving_at = asyncio.run(
            kill_leader_under_load(deployment, url, name))
    finally:
        stop_recorded(folder, print)

    ok = [r for r in results if r.status == 200]
    failed = [r for r in results if r.status != 200]
    after = [r for r in ok if r.started > killed_at]
    prompts = {r.text: r.prompt_ids for r in ok if r.prompt_ids}
    texts = sorted(prompts)
    # A single instance computing each prompt from scratch: what a recompute gives.
    baseline, _ = run_engine(tmp_path, "cold", {
        "model": str(tiny_models["mla"]), "block_size": 32,
        "prompts": [prompts[t] for t in texts], "max_tokens": MAX_TOKENS,
        "max_model_len": 1024, "warm_prefix_cache": True, "one_at_a_time": True})
    cold = dict(zip(texts, baseline["cold_token_ids"], strict=True))
    warm = dict(zip(texts, baseline["token_ids"], strict=True))
    assert expected == {t: warm[t] for t in expected}  # before the kill: a single instance's
    for r in ok:
        if r.ids not in (expected[r.text], cold[r.text]):
            print(f"  {r.text[:12]} at {r.started - killed_at:+.1f}s: {r.ids}, loaded "
                  f"{expected[r.text]}, recomputed {cold[r.text]}")
    wrong = [r.text[:24] for r in ok if r.ids not in (expected[r.text], cold[r.text])]
    print(f"master failover: {len(results)} requests, {len(failed)} failed, "
          f"{len(after)} succeeded after the kill; a new leader served "
          f"{serving_at - killed_at:.1f} s after the kill; "
          f"{sum(r.ids != expected[r.text] for r in ok)} outputs recomputed")
    for r in failed[:5]:
        print(f"  failed: {r.status} {r.error[:160]}")
    assert not wrong, wrong
    assert len(after) >= 12  # served on through the failover


async def kill_leader_under_load(deployment: LocalDeployment, url: str, name: str
                                 ) -> tuple[dict[str, list[int]], list[Completion], float, float]:
    admins = masters(deployment, name)
    assert len(admins) == 2
    await wait_for(lambda: any(health(a).get("service_ready") for a in admins.values()), 60,
                   "a leading master to serve")
    async with aiohttp.ClientSession() as session:
        expected = {}
        for text in PROMPTS:
            result = await complete(session, url, name, text, MAX_TOKENS)
            assert result.status == 200, result.error
            expected[text] = result.ids
        results: list[Completion] = []
        stop = asyncio.Event()
        counter = itertools.count()

        async def client() -> None:
            while not stop.is_set() and (n := next(counter)) < MAX_REQUESTS:
                text = PROMPTS[n % len(PROMPTS)]
                results.append(await complete(session, url, name, text, MAX_TOKENS))

        clients = [asyncio.create_task(client())]
        await wait_for(lambda: len(results) >= 6, 120, "requests before the kill")
        leader = next(p for p, admin in admins.items() if health(admin).get("role") == "leader")
        standby = admins[next(p for p in admins if p != leader)]
        killed_at = time.monotonic()
        deployment.kill(leader)
        await wait_for(lambda: bool(health(standby).get("service_ready")), 120,
                       "the standby to lead and serve")
        serving_at = time.monotonic()
        # Requests started after the new leader serves go on succeeding.
        await wait_for(lambda: sum(r.started > serving_at and r.status == 200
                                   for r in results) >= 12 or all(c.done() for c in clients),
                       300, "requests after the failover")
        stop.set()
        await asyncio.gather(*clients)
    return expected, results, killed_at, serving_at
