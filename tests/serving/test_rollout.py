"""A rollout that changes the KV compatibility (the block size) of a running local 1P1D
deployment (real vLLM, Mooncake, etcd and proxy) under a steady stream of requests, the way
the operator's Deployments roll: new prefill and decode instances start beside the old ones,
and the old ones drain once the proxy routes to new instances of both roles. No request may
fail and no output may be wrong: each equals a single instance's tokens at the old or at the
new block size. The negative control rolls back with the Recreate strategy (old instances
drained before new ones start): the same stream then sees failed requests.

The stream is one request at a time: in bfloat16 vLLM's CPU MLA path is not batch-invariant
for the tiny random model, so only unbatched outputs compare token for token."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Literal

import aiohttp
import pytest
from disagg_devtools.local.cli import load
from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
from disagg_devtools.processes import free_port
from disagg_devtools.waiting import wait_for
from disagg_operator.plan import compatibility_fingerprint
from disagg_operator.spec import DisaggServingSpec

from .conftest import in_private_network
from .engines import run_engine
from .streamed import Completion, complete

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [" ".join(f"request {i} part {j} crosses a rollout" for j in range(8))
           for i in range(6)]
MAX_REQUESTS = 1500  # bounded: the stream stops after the rollout or at this count
MAX_TOKENS = 8
AFTER = 6  # requests that must succeed after the rollout ends
FAILURE_PACE = 0.2  # seconds between requests after a failed one (the load stays bounded)


def with_block_size(spec: DisaggServingSpec, block_size: int) -> DisaggServingSpec:
    return spec.model_copy(update={"model": spec.model.model_copy(
        update={"block_size": block_size})})


def fingerprints(url: str) -> set[str]:
    with urllib.request.urlopen(f"{url}/instances", timeout=5) as response:
        return {i["fingerprint"] for i in json.loads(response.read()) if i["healthy"]}


def decode_alone(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as response:
        text = response.read().decode()
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("disagg_proxy_decode_alone_total{")))


async def roll_under_load(deployment: LocalDeployment, url: str, name: str,
                          spec: DisaggServingSpec,
                          strategy: Literal["RollingUpdate", "Recreate"]
                          ) -> tuple[list[Completion], float, float]:
    """Requests one at a time from before the rollout until AFTER succeeded after it. A
    Recreate rollout (the control) is abandoned at its first failed request: that failure is
    all the control shows, and the deployment is torn down next."""
    results: list[Completion] = []
    done = asyncio.Event()
    counter = itertools.count()
    async with aiohttp.ClientSession() as session:

        async def client() -> None:
            while not done.is_set() and (n := next(counter)) < MAX_REQUESTS:
                result = await complete(session, url, name, PROMPTS[n % len(PROMPTS)],
                                        MAX_TOKENS)
                results.append(result)
                if result.status != 200:
                    await asyncio.sleep(FAILURE_PACE)

        task = asyncio.create_task(client())
        await wait_for(lambda: len(results) >= 3, 120, "requests before the rollout")
        began = time.monotonic()
        rollout = asyncio.create_task(deployment.rollout(spec, timeout=900, strategy=strategy))
        if strategy == "Recreate":
            await wait_for(lambda: rollout.done() or any(r.status != 200 for r in results),
                           900, "a failed request or the rollout's end")
            rollout.cancel()  # nothing, when it ended
            with contextlib.suppress(asyncio.CancelledError):
                await rollout
        else:
            await rollout
        ended = time.monotonic()
        if strategy == "RollingUpdate":
            await wait_for(lambda: sum(r.started > ended and r.status == 200
                                       for r in results) >= AFTER or task.done(),
                           300, "requests after the rollout")
        done.set()
        await task
    return results, began, ended


def test_a_block_size_rollout_under_load_fails_no_request_and_gives_no_wrong_output(
        tiny_models, tmp_path) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    name, spec = load(ROOT / "examples" / "tiny-mla-1p2d.yaml", str(tiny_models["mla"]))
    # A store pod holds the pages: engines lend the store no memory, so the old instances
    # take no stored page with them when they drain. (Without one, pages they held are lost
    # and recomputed after a partial load, which on this CPU build gives other greedy tokens
    # than any single-instance run can reproduce: seen as 5 of 389 requests of one run.)
    spec = spec.model_copy(update={
        "decode": spec.decode.model_copy(update={"replicas": 1}),
        "store": spec.store.model_copy(update={"replicas": 1, "segment_size": "256Mi"})})
    old, new = with_block_size(spec, 32), with_block_size(spec, 16)
    assert compatibility_fingerprint(old) != compatibility_fingerprint(new)
    folder = RunFolder(tmp_path / "run")
    deployment = LocalDeployment(name, old, folder, python=sys.executable,
                                 proxy_port=free_port(), echo=print)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        rolling, began, ended = asyncio.run(
            roll_under_load(deployment, url, name, new, "RollingUpdate"))
        after_rolling = fingerprints(url)
        alone = decode_alone(url)
        recreate, _, _ = asyncio.run(roll_under_load(deployment, url, name, old, "Recreate"))
    finally:
        stop_recorded(folder, print)

    ok = [r for r in rolling + recreate if r.status == 200]
    prompts = {r.text: r.prompt_ids for r in ok if r.prompt_ids}
    texts = sorted(prompts)
    allowed: dict[str, list[list[int]]] = {t: [] for t in texts}
    for block_size in (32, 16):  # a single instance, from scratch and after a cached prefix
        reference, _ = run_engine(tmp_path, f"single-{block_size}", {
            "model": str(tiny_models["mla"]), "block_size": block_size,
            "prompts": [prompts[t] for t in texts], "max_tokens": MAX_TOKENS,
            "max_model_len": 1024, "warm_prefix_cache": True, "one_at_a_time": True})
        for key in ("token_ids", "cold_token_ids"):
            for text, ids in zip(texts, reference[key], strict=True):
                allowed[text].append(ids)
    wrong = [(r.text[:24], r.ids) for r in ok if r.ids not in allowed[r.text]]
    for r in ok:
        if r.ids not in allowed[r.text]:
            phase = "rolling" if r in rolling else "recreate"
            print(f"  wrong ({phase}, {r.started - began:+.1f} s from the rollout's start, "
                  f"{r.started - ended:+.1f} s from its end): {r.text[:10]} {r.ids}; "
                  f"allowed {allowed[r.text]}")
    failed = [r for r in rolling if r.status != 200]
    during = [r for r in rolling if began <= r.started <= ended]
    recreate_failed = [r for r in recreate if r.status != 200]
    print(f"rollout (block size 32 -> 16): {len(rolling)} requests, {len(during)} during the "
          f"{ended - began:.1f} s rollout, {sum(r.started > ended for r in rolling)} after "
          f"it, {len(failed)} failed, {alone} computed by decode "
          f"alone; Recreate back: {len(recreate)} requests, {len(recreate_failed)} failed; "
          f"{len(wrong)} wrong outputs of {len(ok)}")
    for r in (failed + recreate_failed)[:3]:
        print(f"  failed: {r.status} {r.error[:160]}")
    assert not wrong, wrong
    assert not failed, [(r.status, r.error[:120]) for r in failed]
    assert len(during) >= 3  # the stream went on while both generations ran
    assert sum(r.started > ended for r in rolling) >= AFTER  # and on after the old ones went
    assert after_rolling == {compatibility_fingerprint(new)}  # the old ones are gone
    # The control: the same stream sees failures when old instances go before new ones serve.
    assert recreate_failed
