"""Disaggregation never changes an answer: randomized conversations through the proxy of a local
XpYd deployment, in float32, against one plain instance, by per-token logprobs (within
`exactness.TOLERANCE`) and greedy tokens, for GQA and MLA and both connector implementations.

kvhelper runs 2 prefill and 1 decode instances with decode saving, so that the routes a prompt
can take all occur and are counted: prefill loading what another instance stored (each
conversation's last turn also goes through every prefill instance, since the proxy keeps a
conversation where its history is), decode loading after a partial local prefix-cache hit (GQA:
vLLM's CPU MLA backend keeps no prefix cache), skip-prefill, and decode saving. vLLM's connector
runs 1P1D. The negative control corrupts one stored page of a prompt before decode loads it: the
criterion must see it.

The seed is printed; DISAGG_EXACTNESS_SEED replays one."""

from __future__ import annotations

import asyncio
import json
import os
import random
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from disagg_devtools.exactness import TOLERANCE, Conversations, Gap, compare, noise, summary
from disagg_devtools.local.metrics import metric_total
from disagg_devtools.local.runner import LocalDeployment, RunFolder, stop_recorded
from disagg_devtools.processes import free_port
from disagg_operator.spec import parse_spec
from kvhelper.keys import block_key
from kvhelper.transfer_params import KEY_SPACE_KEY, PREFIX_HASH_KEY

from .conftest import in_private_network
from .engines import corrupt_values, run_engine

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 8
TIMEOUT = aiohttp.ClientTimeout(total=120)
CASES = [("mla", "kvhelper"), ("gqa", "kvhelper"), ("mla", "vllm"), ("gqa", "vllm")]


@dataclass
class Stack:
    kind: str
    implementation: str
    model: Path
    name: str
    url: str
    deployment: LocalDeployment

    @property
    def served(self) -> str:
        return self.deployment.spec.model.served_model_name or self.name

    def urls(self, role: str) -> list[str]:
        return [f"http://127.0.0.1:{item.spec.port}" for item in self.deployment.started
                if item.spec.role == role and item.spec.port]

    def store_setting(self, name: str) -> str:
        """A Mooncake setting the instances run with (master_server_address, metadata_server):
        the plan hands them a config file through the environment."""
        item = next(i for i in self.deployment.started if i.spec.role == "prefill")
        path = next(v for v in item.spec.env.values() if v.endswith("mooncake.json"))
        return str(json.loads(Path(path).read_text())[name])


@pytest.fixture(scope="module", params=CASES, ids=[f"{k}-{i}" for k, i in CASES])
def stack(request, tiny_models, tmp_path_factory) -> Iterator[Stack]:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    kind, implementation = request.param
    doc = yaml.safe_load((ROOT / "examples" / f"tiny-{kind}-1p2d.yaml").read_text())
    spec_doc = doc["spec"]
    spec_doc["model"] |= {"name": str(tiny_models[kind]), "dtype": "float32"}
    kvhelper = implementation == "kvhelper"
    spec_doc["prefill"]["replicas"] = 2 if kvhelper else 1
    spec_doc["decode"]["replicas"] = 1
    spec_doc["kvTransfer"] |= {"implementation": implementation, "saveDecodeCache": kvhelper}
    name = f"exact-{kind}-{implementation}"
    folder = RunFolder(tmp_path_factory.mktemp(name))
    deployment = LocalDeployment(name, parse_spec(spec_doc), folder, python=sys.executable,
                                 proxy_port=free_port(), echo=print)
    try:
        url = asyncio.run(deployment.up(timeout=900))
        yield Stack(kind, implementation, tiny_models[kind], name, url, deployment)
    finally:
        stop_recorded(folder, print)


@dataclass
class Answer:
    prompt_ids: list[int]
    tokens: list[int]
    logprobs: list[float]
    text: str


async def ask(session: aiohttp.ClientSession, url: str, model: str, prompt: str | list[int],
              **extra: Any) -> tuple[Answer, dict[str, Any]]:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "logprobs": 1, "return_token_ids": True, **extra}
    async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        data = await response.json()
        assert response.status == 200, data
    choice = data["choices"][0]
    answer = Answer(list(choice.get("prompt_token_ids") or data.get("prompt_token_ids")),
                    list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]),
                    choice["text"])
    return answer, data


async def counters(session: aiohttp.ClientSession, stack: Stack) -> dict[str, float]:
    """What each route did so far, from the instances' and the proxy's /metrics."""
    async def total(urls: list[str], name: str) -> float:
        found = 0.0
        for url in urls:
            async with session.get(f"{url}/metrics") as response:
                found += metric_total(await response.text(), name)
        return found

    prefill, decode = stack.urls("prefill"), stack.urls("decode")
    async with session.get(f"{stack.url}/metrics") as response:
        proxy = await response.text()
    skip = sum(float(line.rsplit(" ", 1)[1]) for line in proxy.splitlines()
               if line.startswith('disagg_proxy_route_decisions_total{kind="skip_prefill"}'))
    return {
        "prefill_loaded_blocks": await total(prefill, "vllm:kvhelper_lookup_hit_blocks_total"),
        "decode_loaded_requests": await total(decode, "vllm:kvhelper_requests_loaded_total"),
        "decode_local_hit_tokens": await total(decode, "vllm:prefix_cache_hits_total"),
        "skip_prefill": skip,
        "decode_saves": await total(decode, "vllm:kvhelper_decode_saves_total"),
        "external_hit_tokens": await total(prefill + decode,
                                           "vllm:external_prefix_cache_hits_total"),
    }


def plain_instance(stack: Stack, prompts: list[list[int]], tmp: Path) -> dict[str, Any]:
    """One ordinary vLLM instance on the same model in float32, one prompt at a time: each
    computed whole ("cold_logprobs", the reference), then again over its own cached blocks
    ("logprobs": how far two ways of computing one prompt differ here, the noise)."""
    result, _ = run_engine(tmp, f"plain-{stack.kind}", {
        "model": str(stack.model), "block_size": 32, "prompts": prompts,
        "max_tokens": MAX_TOKENS, "max_model_len": 1024, "logprobs": 2,
        "engine_args": {"dtype": "float32"}, "warm_prefix_cache": True, "one_at_a_time": True})
    return result


def test_answers_through_prefill_and_decode_equal_a_plain_instance(stack, tmp_path) -> None:
    seed = int(os.environ.get("DISAGG_EXACTNESS_SEED") or random.randrange(1 << 31))
    print(f"{stack.kind} {stack.implementation}: seed {seed}")
    talk = Conversations(seed)

    async def run() -> tuple[list[Answer], dict[str, float]]:
        async with aiohttp.ClientSession() as session:
            before = await counters(session, stack)
            answers: list[Answer] = []
            last: dict[int, tuple[str, str]] = {}  # conversation: (prompt, answer text)
            for conversation, turn in talk.plan():
                if turn == -1:  # asked again, word for word
                    text = last[conversation][0]
                else:
                    previous = last.get(conversation)
                    text = talk.prompt(conversation, previous[1] if previous else None)
                answer, _ = await ask(session, stack.url, stack.served, text)
                answers.append(answer)
                last[conversation] = (text, answer.text)
            # The proxy keeps a conversation on the prefill instance that holds its history:
            # each conversation's next turn also goes through every prefill instance, so that
            # one of them computes it over what another stored.
            for conversation in range(talk.conversations):
                text = talk.prompt(conversation, last[conversation][1])
                for prefill_url in stack.urls("prefill"):
                    answers.append(await _through(session, stack, prefill_url, text))
            routes = await _settled(session, stack, before)
            return answers, routes

    answers, routes = asyncio.run(run())
    plain = plain_instance(stack, [a.prompt_ids for a in answers], tmp_path)
    measured_noise = max(noise(w, c) for w, c in zip(plain["logprobs"], plain["cold_logprobs"],
                                                     strict=True))
    gaps = [compare(i, a.tokens, a.logprobs, plain["cold_logprobs"][i])
            for i, a in enumerate(answers)]
    report = summary(gaps) | {"noise": measured_noise, "routes": routes, "seed": seed}
    print(f"{stack.kind} {stack.implementation}: {report}")
    assert measured_noise <= TOLERANCE / 10, report  # the tolerance stays meaningful
    assert not report["not_exact"], (report, [g for g in gaps if not g.exact])
    for route in expected_routes(stack):
        assert routes[route] > 0, (route, report)


async def _through(session: aiohttp.ClientSession, stack: Stack, prefill_url: str,
                   text: str) -> Answer:
    """A prompt prefilled by this instance and decoded by the decode instance, as the proxy
    pairs them."""
    _, prefilled = await ask(session, prefill_url, stack.served, text, max_tokens=1,
                             kv_transfer_params={"do_remote_decode": True})
    answer, _ = await ask(session, stack.urls("decode")[0], stack.served, text,
                          kv_transfer_params=prefilled["kv_transfer_params"])
    return answer


def expected_routes(stack: Stack) -> tuple[str, ...]:
    """The routes a run on this stack must have taken (each counted above zero)."""
    if stack.implementation != "kvhelper":
        return ("external_hit_tokens",)
    routes = ("prefill_loaded_blocks", "decode_loaded_requests", "skip_prefill", "decode_saves")
    return (*routes, "decode_local_hit_tokens") if stack.kind == "gqa" else routes


async def _settled(session: aiohttp.ClientSession, stack: Stack,
                   before: dict[str, float]) -> dict[str, float]:
    """The routes' counts once vLLM has published every expected route of this run (it
    publishes every 10 s or so), within 40 s."""
    deadline = asyncio.get_running_loop().time() + 40
    while True:
        now = await counters(session, stack)
        moved = {k: now[k] - before[k] for k in now}
        if all(moved[r] > 0 for r in expected_routes(stack)) \
                or asyncio.get_running_loop().time() > deadline:
            return moved
        await asyncio.sleep(0.5)


@pytest.mark.parametrize("stack", [c for c in CASES if c[1] == "kvhelper"], indirect=True,
                         ids=[f"{k}-{i}" for k, i in CASES if i == "kvhelper"])
def test_one_corrupted_stored_page_breaks_the_criterion(stack, tmp_path, monkeypatch) -> None:
    """The negative control: prefill stores a new prompt, one of its pages is corrupted in the
    store, decode loads it. The answer must fail the comparison that the real runs pass. (On
    kvhelper's stacks, whose page keys the test can compute; the criterion is the same.)"""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")  # this process's store client
    words = Conversations(random.randrange(1 << 31))
    text = words.prompt(0, None) + " " + words.prompt(0, "fresh")

    async def run() -> Answer:
        async with aiohttp.ClientSession() as session:
            prefill_url, decode_url = stack.urls("prefill")[0], stack.urls("decode")[0]
            _, prefilled = await ask(session, prefill_url, stack.served, text, max_tokens=1,
                                     kv_transfer_params={"do_remote_decode": True})
            params = prefilled["kv_transfer_params"]
            space = params[KEY_SPACE_KEY]
            key = block_key(space["fingerprint"], params[PREFIX_HASH_KEY],
                            None if space["shards"] is None else (space["shards"], 0))
            await asyncio.to_thread(_corrupt_when_stored, stack.store_setting(
                "master_server_address"), stack.store_setting("metadata_server"), key)
            return (await ask(session, decode_url, stack.served, text,
                              kv_transfer_params=params))[0]

    corrupted = asyncio.run(run())
    plain = plain_instance(stack, [corrupted.prompt_ids], tmp_path)
    gap: Gap = compare(0, corrupted.tokens, corrupted.logprobs, plain["cold_logprobs"][0])
    print(f"{stack.kind}: one corrupted page: largest gap {gap.largest:.3g}, "
          f"tokens parted at {gap.parted_at}")
    assert not gap.exact, gap


def _corrupt_when_stored(master: str, metadata_server: str, key: str) -> None:
    """Prefill stores in the background: wait for the page (30 s at most), then corrupt it."""
    import time

    from .engines import store_client

    deadline = time.monotonic() + 30
    with store_client(master, metadata_server) as client:
        while not all(client.exists([key], strict=True)):
            assert time.monotonic() < deadline, f"{key} never stored"
            time.sleep(0.1)
    corrupt_values(master, [key], metadata_server)


CUT_AFTER_EVENTS = 4  # tokens a client has when the decode serving its stream fails


class StreamCutter:
    """An HTTP relay in front of a decode instance that drops every streamed answer after
    `CUT_AFTER_EVENTS` events: to the proxy, the instance died mid-stream (the instance
    itself, shared by the other tests, keeps running)."""

    def __init__(self, target: str) -> None:
        self.target, self.port, self.cut = target, free_port(), 0
        self._runner: Any = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> StreamCutter:
        from aiohttp import web

        self._session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._relay)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._runner.cleanup()
        await self._session.close()

    async def _relay(self, request: Any) -> Any:
        from aiohttp import web

        async with self._session.request(request.method, f"{self.target}{request.path_qs}",
                                         data=await request.read(),
                                         headers={"Content-Type": "application/json"}
                                         ) as upstream:
            if "text/event-stream" not in upstream.headers.get("Content-Type", ""):
                return web.Response(body=await upstream.read(), status=upstream.status,
                                    content_type=upstream.content_type)
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            events = 0
            async for line in upstream.content:
                await response.write(line)
                events += line == b"\n"
                if events == CUT_AFTER_EVENTS:
                    self.cut += 1
                    assert request.transport is not None
                    request.transport.close()  # the instance "dies" mid-stream
                    return response
            return response


async def _stream(session: aiohttp.ClientSession, url: str, model: str,
                  text: str) -> tuple[list[int], list[float], list[list[list[float]]]]:
    """A streamed greedy answer: its token ids, their logprobs, and its top two per step."""
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS + 4, "temperature": 0,
            "stream": True, "logprobs": 2, "return_tokens_as_token_ids": True,
            "return_token_ids": True}
    tokens: list[int] = []
    logprobs: list[float] = []
    tops: list[list[list[float]]] = []
    async with session.post(f"{url}/v1/completions", json=body, timeout=TIMEOUT) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            choice = chunk["choices"][0]
            tokens += choice.get("token_ids") or []
            found = choice.get("logprobs") or {}
            logprobs += found.get("token_logprobs") or []
            for top in found.get("top_logprobs") or []:
                tops.append(sorted(([float(k.split(":")[1]), v] for k, v in top.items()),
                                   key=lambda pair: -pair[1]))
    return tokens, logprobs, tops


async def _proxy_with_a_dying_decode(stack: Stack, cutter: StreamCutter) -> Any:
    """The proxy (in this process) in front of the stack's instances, the decode reached first
    through the cutter."""
    from aiohttp import web
    from kvhelper.discovery import StaticDiscovery
    from kvhelper.proxy.app import Proxy, ProxyConfig

    proxy = Proxy(ProxyConfig(health_interval=60.0),
                  StaticDiscovery(stack.urls("prefill"), [cutter.url, stack.urls("decode")[0]]))
    runner = web.AppRunner(proxy.app())
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@pytest.mark.parametrize("stack", [c for c in CASES if c[1] == "kvhelper"], indirect=True,
                         ids=[f"{k}-{i}" for k, i in CASES if i == "kvhelper"])
def test_a_stream_continued_after_its_decode_failed_equals_an_uninterrupted_one(
        stack, monkeypatch) -> None:
    """The decode instance streaming an answer fails after 4 tokens reached the client; the
    proxy continues the stream on another decode instance from the prompt's and the tokens'
    ids. The client's whole answer must equal the uninterrupted one by the exactness criterion
    (greedy tokens, float32 logprobs within TOLERANCE). The negative control continues from one
    token too few: the criterion must see it. (On kvhelper's stacks, MLA and GQA: the
    continuation is the proxy's, whichever connector moved the prompt's KV.)"""
    from kvhelper.proxy.continuation import StreamRecord

    talk = Conversations(random.randrange(1 << 31))
    texts = [talk.prompt(c, None) for c in range(3)]

    async def continued(text: str) -> tuple[list[int], list[float], int]:
        async with StreamCutter(stack.urls("decode")[0]) as cutter, \
                aiohttp.ClientSession() as session:
            runner, url = await _proxy_with_a_dying_decode(stack, cutter)
            try:
                tokens, logprobs, _ = await _stream(session, url, stack.served, text)
            finally:
                await runner.cleanup()
            return tokens, logprobs, cutter.cut

    async def run(negative: bool) -> list[Gap]:
        gaps = []
        async with aiohttp.ClientSession() as session:
            for i, text in enumerate(texts[:1] if negative else texts):
                whole_tokens, _, reference = await _stream(session, stack.url, stack.served,
                                                           text)
                tokens, logprobs, cut = await continued(text)
                assert cut == 1, "the stream was not cut"
                # (one token short, the client gets that token twice: one more in all)
                assert len(tokens) == len(whole_tokens) + negative == MAX_TOKENS + 4 + negative
                gaps.append(compare(i, tokens, logprobs, reference))
        return gaps

    gaps = asyncio.run(run(negative=False))
    print(f"{stack.kind} {stack.implementation}: continued streams: {summary(gaps)}")
    assert all(g.exact for g in gaps), gaps

    real = StreamRecord.continuation

    def one_token_short(self: StreamRecord, max_model_len: int | None) -> Any:
        self.generated.pop()
        return real(self, max_model_len)

    monkeypatch.setattr(StreamRecord, "continuation", one_token_short)
    (broken,) = asyncio.run(run(negative=True))
    print(f"{stack.kind} {stack.implementation}: continued one token short: {broken}")
    assert not broken.exact, broken
