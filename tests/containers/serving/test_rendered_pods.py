"""The operator's rendered seed topology (tiny MLA, 1 prefill, 2 decode) running as real
containers from the images `make images` builds: the pod specs as a cluster runs them (command
lines, env, ConfigMap, volumes, securityContext with read-only roots, probes, preStop).

All pods start at once and converge through their own probes and retries. Then: answers through
the proxy equal one plain vLLM (the decode pod without a connector) by float32 logprobs, with
KV moved; a decode container killed with SIGKILL is restarted and no request fails; a rolling
change of a decode, its preStop drain included, fails no request.

The seed is printed; DISAGG_EXACTNESS_SEED replays one."""

from __future__ import annotations

import asyncio
import copy
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from disagg_devtools.containers.podman import podman
from disagg_devtools.containers.pods import PodPlan
from disagg_devtools.exactness import (
    TOLERANCE,
    Conversations,
    compare,
    noise,
    sentence,
    summary,
)
from disagg_devtools.local.metrics import metric_total

from .conftest import Deployment, healthy_instances, wait_routed

pytestmark = pytest.mark.asyncio(loop_scope="package")
MAX_TOKENS = 8
TIMEOUT = aiohttp.ClientTimeout(total=180)
LOAD_WORKERS = 4
LOAD_LIMIT = 3000  # requests, at most, per load phase (a decode's restart takes minutes here)
LOAD_SECONDS = 900  # and seconds


async def complete(session: aiohttp.ClientSession, url: str, model: str,
                   prompt: str | list[int], **extra: Any) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, **extra}
    async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        data = await response.json()
        assert response.status == 200, data
    return dict(data["choices"][0]) | {"prompt_ids": data["choices"][0].get("prompt_token_ids")
                                       or data.get("prompt_token_ids")}


def top_logprobs(choice: dict[str, Any]) -> list[list[list[float]]]:
    """Per step, [[token id, logprob], ...] best first (return_tokens_as_token_ids)."""
    steps = []
    for top in choice["logprobs"]["top_logprobs"]:
        ranked = sorted(top.items(), key=lambda kv: -kv[1])
        steps.append([[float(k.removeprefix("token_id:")), v] for k, v in ranked])
    return steps


async def decode_loads(session: aiohttp.ClientSession, deployment: Deployment) -> float:
    total = 0.0
    for pod in deployment.role("decode"):
        async with session.get(f"{deployment.url(pod)}/metrics") as response:
            total += metric_total(await response.text(), "vllm:kvhelper_blocks_loaded_total")
    return total


async def test_answers_through_the_proxy_equal_a_plain_instance(deployment: Deployment) -> None:
    seed = int(os.environ.get("DISAGG_EXACTNESS_SEED") or random.randrange(1 << 31))
    talk = Conversations(seed)
    print(f"seed {seed}; every pod ready {deployment.ready_seconds:.0f} s after they started")
    async with aiohttp.ClientSession() as session:
        loaded_before = await decode_loads(session, deployment)
        answers: list[dict[str, Any]] = []
        last: dict[int, tuple[str, str]] = {}
        for conversation, turn in talk.plan():
            if turn == -1:
                text = last[conversation][0]
            else:
                previous = last.get(conversation)
                text = talk.prompt(conversation, previous[1] if previous else None)
            answer = await complete(session, deployment.proxy, deployment.served, text)
            answers.append(answer)
            last[conversation] = (text, answer["text"])
        plain_url = deployment.url(deployment.plain)
        reference, again = [], []
        for answer in answers:
            for runs in (reference, again):
                runs.append(top_logprobs(await complete(
                    session, plain_url, deployment.served, answer["prompt_ids"], logprobs=2,
                    return_tokens_as_token_ids=True)))
        # vLLM publishes its counters every few seconds: wait for this run's loads.
        deadline = time.monotonic() + 30
        while (loaded := await decode_loads(session, deployment) - loaded_before) == 0 \
                and time.monotonic() < deadline:
            await asyncio.sleep(1)
    gaps = [compare(i, a["token_ids"], a["logprobs"]["token_logprobs"], reference[i])
            for i, a in enumerate(answers)]
    measured_noise = max(noise(a, b) for a, b in zip(reference, again, strict=True))
    report = summary(gaps) | {"noise": measured_noise, "decode_loaded_blocks": loaded,
                              "seed": seed}
    print(report)
    assert measured_noise <= TOLERANCE / 10, report
    assert not report["not_exact"], (report, [g for g in gaps if not g.exact])
    assert loaded > 0, report  # KV moved from prefill to decode through the store


@dataclass
class Load:
    """Completions through the proxy from a few clients at once, bounded in count and time."""

    deployment: Deployment
    ok: int = 0
    failed: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)

    async def run(self) -> None:
        deadline = time.monotonic() + LOAD_SECONDS
        async with aiohttp.ClientSession() as session:
            await asyncio.gather(*(self._client(session, i, deadline)
                                   for i in range(LOAD_WORKERS)))

    async def _client(self, session: aiohttp.ClientSession, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set() and time.monotonic() < deadline \
                and self.ok + len(self.failed) < LOAD_LIMIT:
            body = {"model": self.deployment.served, "prompt": sentence(rng, rng.randint(20, 90)),
                    "max_tokens": 16, "temperature": 0}
            try:
                async with session.post(f"{self.deployment.proxy}/v1/completions", json=body,
                                        timeout=TIMEOUT) as response:
                    text = await response.text()
                if response.status == 200:
                    self.ok += 1
                else:
                    self.failed.append(f"{response.status}: {text[:300]}")
            except (aiohttp.ClientError, TimeoutError) as error:
                self.failed.append(repr(error))

    def spent(self) -> bool:
        return self.ok + len(self.failed) >= LOAD_LIMIT

    async def until(self, answered: int, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.ok < answered:
            assert not self.failed, (self.ok, self.failed[:5])
            assert not self.spent(), f"the load's {LOAD_LIMIT} requests ran out"
            assert time.monotonic() < deadline, f"{self.ok} answered, not {answered}"
            await asyncio.sleep(0.2)


async def _until(deployment: Deployment, condition: Any, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not condition():
        deployment.cluster.check_loop()
        assert time.monotonic() - began < timeout, what
        await asyncio.sleep(0.2)
    return time.monotonic() - began


async def test_a_decode_container_killed_is_restarted_and_no_request_fails(
        deployment: Deployment) -> None:
    victim = deployment.role("decode")[0]
    vllm = victim.container("vllm")
    restarts = vllm.restarts
    load = Load(deployment)
    running = asyncio.create_task(load.run())
    try:
        await load.until(answered=5)
        answered_before = load.ok
        await podman("kill", "--signal", "KILL", vllm.name)
        await _until(deployment, lambda: not victim.ready, 30, "the kubelet never saw the kill")
        back = await _until(deployment, lambda: victim.ready, 600,
                            "the killed decode never came back")
        routed = time.monotonic()
        await wait_routed(deployment, [victim], time.monotonic() + 120)
        await load.until(answered=load.ok + 5)
    finally:
        load.stop.set()
        await running
    print(f"kubelet errors: {deployment.cluster.loop_errors}")
    print(f"decode SIGKILLed: restarted {vllm.restarts - restarts} time(s), ready again after "
          f"{back:.0f} s, routed again {time.monotonic() - routed:.0f} s later; requests "
          f"{answered_before} before, {load.ok} answered in all, {len(load.failed)} failed")
    assert vllm.restarts == restarts + 1, victim.events
    assert not load.failed, load.failed[:5]


async def test_a_rolling_change_of_a_decode_drains_it_and_fails_no_request(
        deployment: Deployment) -> None:
    old = deployment.role("decode")[-1]
    changed = copy.deepcopy(dict(old.plan.spec))
    changed["containers"][0].setdefault("env", []).append(
        {"name": "DISAGG_E2E_REVISION", "value": "2"})
    new_plan = PodPlan(f"{old.name}-r2", old.plan.namespace, old.plan.workload,
                       old.plan.labels, changed, dns_names=old.plan.dns_names)
    load = Load(deployment)
    running = asyncio.create_task(load.run())
    try:
        await load.until(answered=5)
        new, = await deployment.cluster.start_pods([new_plan])
        await deployment.cluster.wait_ready(600, [new.name])
        await wait_routed(deployment, [new], time.monotonic() + 120)
        stopped_in = await deployment.cluster.delete_pod(old.name)
        assert deployment.url(old) not in await healthy_instances(deployment)
        await load.until(answered=load.ok + 5)
    finally:
        load.stop.set()
        await running
    print(f"decode replaced under load: old pod stopped in {stopped_in:.1f} s "
          f"({[e for e in old.events if e.startswith('preStop')]}); {load.ok} answered, "
          f"{len(load.failed)} failed")
    assert any(e.startswith("preStop") and e.endswith("exit 0") for e in old.events), old.events
    assert not load.failed, load.failed[:5]
