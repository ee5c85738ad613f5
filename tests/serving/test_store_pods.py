"""What a scale-down costs the store: a local 1P2D deployment (real vLLM, Mooncake, etcd,
proxy) stores a set of prompts, then loses a decode instance the way a pod deletion takes it.
Without store pods every engine lends memory to the pool and the leaving one takes the pages
placed in it; with `spec.store` the pages live in a Mooncake store process
(`mooncake_client`) and the engines lend none, so none are lost.

Sent again, a prompt the store still holds whole skips prefill and must give exactly the
tokens it gave the first time (decode loads the same pages). One that lost pages is sent to
prefill, which loads the leading pages left and computes the rest: it must succeed, but its
tokens may differ from the first time's, as a single instance's do between a prompt computed
at once and one computed after a cached prefix (bfloat16 sums in another order; the tiny
random model's greedy choice flips on such differences). Tests of the recompute path itself
compare with a single instance: test_local_e2e."""

from __future__ import annotations

import asyncio
import re
import sys
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
from disagg_devtools.local.cli import load
from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
from disagg_devtools.processes import free_port
from disagg_devtools.waiting import wait_for

from .conftest import in_private_network
from .test_local_drain import generate

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [" ".join(f"topic {i} part {j} keeps its pages in the pool" for j in range(10))
           for i in range(12)]


def master_metrics(deployment: LocalDeployment, name: str) -> dict[str, float]:
    master = deployment.find(f"{name}-mooncake-master-0")
    port = re.search(r"--metrics_port=(\d+)", " ".join(master.spec.argv))
    assert port is not None
    with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics",
                                timeout=10) as response:
        text = response.read().decode()
    return {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
            if line.startswith(("master_key_count ", "master_active_clients ",
                                "master_total_capacity_bytes "))}


@pytest.mark.parametrize("store_pods", [0, 1])
def test_a_scale_down_loses_pages_only_without_store_pods(tiny_models, tmp_path,
                                                          store_pods: int) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    name, spec = load(ROOT / "examples" / "tiny-mla-1p2d.yaml", str(tiny_models["mla"]))
    spec = spec.model_copy(update={"store": spec.store.model_copy(
        update={"replicas": store_pods, "segment_size": "256Mi"})})
    folder = RunFolder(tmp_path / "run")
    deployment = LocalDeployment(name, spec, folder, python=sys.executable,
                                 proxy_port=free_port(), echo=print)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        outcome = asyncio.run(scale_down(deployment, url, name))
    finally:
        stop_recorded(folder, print)
    print(f"store pods {store_pods}: {outcome.lost} of {outcome.lost + outcome.kept} stored "
          f"pages lost with decode-1; {outcome.recomputed} of {len(PROMPTS)} prompts went to "
          f"prefill again, {outcome.changed} of those gave other tokens")
    assert not outcome.failed, outcome.failed
    assert not outcome.wrong, outcome.wrong  # whole in the store: the same pages, same tokens
    if store_pods:
        assert outcome.lost == 0 and outcome.recomputed == 0
    else:  # negative control: the engine's own segment held some
        assert outcome.lost > 0 and outcome.recomputed > 0


@dataclass
class Outcome:
    lost: int = 0  # store keys gone with the instance
    kept: int = 0
    recomputed: int = 0  # prompts sent to prefill again
    changed: int = 0  # of those, with other tokens than the first time
    failed: list[tuple[int, object]] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # skipped prefill, yet other tokens


def proxy_routes(url: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith('disagg_proxy_route_decisions_total{kind="prefill"}'))


async def scale_down(deployment: LocalDeployment, url: str, name: str) -> Outcome:
    model = name
    async with aiohttp.ClientSession() as session:
        first = {}
        for text in PROMPTS:
            status, ids = await generate(session, url, model, text)
            assert status == 200, ids
            first[text] = ids
        before = master_metrics(deployment, name)
        segments_before = before["master_total_capacity_bytes"]
        assert before["master_key_count"] > 0
        clients_before = before["master_active_clients"]
        why = await deployment.drain(f"{name}-decode-1")
        assert "idle for" in why, why
        if deployment.spec.store.replicas:
            # decode-1 lent no memory: the master never counted it as a segment's client.
            after = master_metrics(deployment, name)
            assert after["master_active_clients"] == clients_before
            assert after["master_total_capacity_bytes"] == segments_before
        else:
            # The master forgets a client (and unmounts its segment) after its TTL.
            await wait_for(lambda: master_metrics(deployment, name)["master_active_clients"]
                           < clients_before, 60, "the master to drop decode-1")
            after = master_metrics(deployment, name)
            assert after["master_total_capacity_bytes"] < segments_before
        outcome = Outcome(lost=int(before["master_key_count"] - after["master_key_count"]),
                          kept=int(after["master_key_count"]))
        for text in PROMPTS:  # one at a time, so that the proxy's route counter names each
            routed = proxy_routes(url)
            status, ids = await generate(session, url, model, text)
            if status != 200:
                outcome.failed.append((status, ids))
            elif proxy_routes(url) > routed:
                outcome.recomputed += 1
                outcome.changed += ids != first[text]
            elif ids != first[text]:
                outcome.wrong.append(text)
        return outcome
