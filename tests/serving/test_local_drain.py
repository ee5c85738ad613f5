"""Scale-down without losing a request: a local 2P2D deployment (real vLLM, Mooncake, etcd,
proxy) under a steady stream of requests loses one decode and then one prefill instance the
way a pod deletion takes them (registrar first, then the drain hook, then vLLM). Every request
must succeed and give the tokens the same deployment gave before the drains (other tests hold
those equal to a single instance's)."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from disagg_devtools.local.cli import load
from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
from disagg_devtools.processes import free_port

from .conftest import in_private_network
from .streamed import complete

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [" ".join(f"case {i} step {j} moves pages through the store" for j in range(12))
           for i in range(6)]
MAX_REQUESTS = 400  # bounded: the load stops after the drains or at this count


async def generate(session: aiohttp.ClientSession, url: str, model: str, text: str
                   ) -> tuple[int, list[int] | str]:
    result = await complete(session, url, model, text)
    return (200, result.ids) if result.status == 200 else (result.status, result.error)


async def instances(session: aiohttp.ClientSession, url: str) -> list[dict[str, Any]]:
    async with session.get(f"{url}/instances") as response:
        found: list[dict[str, Any]] = await response.json()
        return found


def test_draining_a_decode_and_a_prefill_under_load_fails_nothing(tiny_models, tmp_path
                                                                  ) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    name, spec = load(ROOT / "examples" / "tiny-gqa-1p2d.yaml", str(tiny_models["gqa"]))
    # Every request goes through a prefill (no store routing), so both drains see traffic.
    spec = spec.model_copy(update={
        "prefill": spec.prefill.model_copy(update={"replicas": 2}),
        "proxy": spec.proxy.model_copy(update={"store_routing": False}),
        "kv_transfer": spec.kv_transfer.model_copy(update={
            "extra_config": {**spec.kv_transfer.extra_config, "store_lookup": False}})})
    folder = RunFolder(tmp_path / "run")
    deployment = LocalDeployment(name, spec, folder, python=sys.executable,
                                 proxy_port=free_port(), echo=print)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        asyncio.run(drain_under_load(deployment, url, spec.model.served_model_name or name,
                                     name))
    finally:
        stop_recorded(folder, print)


async def drain_under_load(deployment: LocalDeployment, url: str, model: str,
                           name: str) -> None:
    async with aiohttp.ClientSession() as session:
        expected = {}
        for text in PROMPTS:
            status, ids = await generate(session, url, model, text)
            assert status == 200, ids
            expected[text] = ids
        results: list[tuple[str, int, list[int] | str]] = []
        stop = asyncio.Event()
        counter = itertools.count()

        async def client() -> None:
            while not stop.is_set() and (n := next(counter)) < MAX_REQUESTS:
                text = PROMPTS[n % len(PROMPTS)]
                status, ids = await generate(session, url, model, text)
                results.append((text, status, ids))

        clients = [asyncio.create_task(client()) for _ in range(3)]
        marks = [len(results)]
        for instance in (f"{name}-decode-1", f"{name}-prefill-1"):
            why = await deployment.drain(instance)
            assert "idle for" in why, why  # it finished its work, no give-up
            marks.append(len(results))
        while len(results) < marks[-1] + 12 and not all(c.done() for c in clients):
            await asyncio.sleep(0.2)  # the remaining pair keeps serving
        stop.set()
        await asyncio.gather(*clients)
        failed = [(status, ids) for _, status, ids in results if status != 200]
        wrong = [text for text, status, ids in results if status == 200
                 and ids != expected[text]]
        assert not failed and not wrong, (failed[:3], len(wrong))
        assert marks[1] > marks[0] and marks[2] > marks[1]  # served while draining
        left = await instances(session, url)
        assert sorted(i["role"] for i in left) == ["decode", "prefill"]
