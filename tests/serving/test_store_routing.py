"""Store-aware routing in the proxy, against test doubles of vLLM's server (fake_vllm.py) and of
the store lookup (named as such), with the tiny model's real tokenizer and vLLM's real hashing.
The real engines, store and proxy together run in test_local_e2e.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from kvhelper.discovery import StaticDiscovery
from kvhelper.proxy.brief_wait import BriefWait
from kvhelper.proxy.held_prefixes import HeldPrefixes
from kvhelper.proxy.prompt_blocks import BlockHasher, PromptTokenizer, TokenizerSource
from kvhelper.proxy.store_routing import StoreRouter
from kvhelper.stored_prefix import KeySpace
from kvhelper.transfer_params import (
    IDENTITY_KEY,
    KEY_SPACE_KEY,
    PREFIX_HASH_KEY,
    STORED_HINT_KEY,
    TOKENS_KEY,
    load_from_store,
)

from .test_proxy import post

BLOCK = 16
SPACE = KeySpace("layout-fp", None)
IDENTITY = {"model": "tiny", "block_size": BLOCK, "hash": "sha256", "mla": True}
PROMPT = " ".join(f"word{i}" for i in range(60))


class FakeLookup:
    """A test double of StoredPrefixLookup: the store holds `held` block hashes; `fail` makes
    it answer with an error, `delay` makes it slow."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.delay = 0.0
        self.fail = False
        self.paused = False
        self.failures: list[BaseException] = []
        self.asked: list[tuple[KeySpace, list[str]]] = []
        self._threads = ThreadPoolExecutor(8)

    def submit(self, space: KeySpace, hashes: Sequence[str]) -> Future[int]:
        self.asked.append((space, list(hashes)))
        return self._threads.submit(self._found, list(hashes))

    def _found(self, hashes: list[str]) -> int:
        time.sleep(self.delay)
        if self.fail:
            raise RuntimeError("the store failed")
        found = 0
        while found < len(hashes) and hashes[found] in self.held:
            found += 1
        return found

    def failed(self, err: BaseException) -> None:
        self.failures.append(err)

    def close(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)


@pytest.fixture
def tokenizer_source(tiny_models: dict[str, Path]) -> TokenizerSource:
    return TokenizerSource(str(tiny_models["mla"]))


def prompt_hashes(source: TokenizerSource, body: dict[str, Any], chat: bool = False,
                  salt: str | None = None) -> tuple[list[int], list[str]]:
    tokens = PromptTokenizer(source).tokens(chat, body)
    return tokens, BlockHasher("sha256").hashes(tokens, BLOCK, (len(tokens) - 1) // BLOCK, salt)


async def routed(tokenizer_source: TokenizerSource, backends: Any, start_proxy: Any,
                 lookup: FakeLookup, **config: Any) -> tuple[Any, Any, str, StoreRouter]:
    prefill_params = load_from_store(BLOCK, "h", IDENTITY) | {KEY_SPACE_KEY: SPACE.to_json()}
    prefill = await backends("p0", prefill_params=prefill_params)
    decode = await backends("d0")
    router = StoreRouter(tokenizer_source, lookup, **config)
    proxy = await start_proxy([], [], discovery=StaticDiscovery([prefill.url], [decode.url],
                                                                 model="tiny"), router=router)
    await asyncio.wait_for(router.ready.wait(), 60)
    return prefill, decode, proxy, router


async def metrics(proxy: str) -> str:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/metrics") as response:
        return await response.text()


async def test_a_stored_prompt_skips_prefill_and_decode_is_told_to_load_it(
        tokenizer_source, backends, start_proxy):
    lookup = FakeLookup()
    prefill, decode, proxy, _ = await routed(tokenizer_source, backends, start_proxy, lookup)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    # Nothing learned yet: prefill, as today; its answer says how the store's keys are made.
    assert (await post(f"{proxy}/v1/completions", body))[0] == 200
    assert len(prefill.requests) == 1 and not lookup.asked
    tokens, hashes = prompt_hashes(tokenizer_source, body)
    assert len(hashes) >= 3
    # Part of it stored: prefill (which loads that part itself).
    lookup.held = set(hashes[:2])
    assert (await post(f"{proxy}/v1/completions", body))[0] == 200
    assert len(prefill.requests) == 2
    assert lookup.asked[-1] == (SPACE, hashes)
    # ... and is told what the proxy found, so that its connector need not ask again; the
    # first request (nothing learned, no lookup) was told nothing.
    assert STORED_HINT_KEY not in prefill.requests[0]["kv_transfer_params"]
    assert prefill.requests[1]["kv_transfer_params"][STORED_HINT_KEY] == {
        "tokens": 2 * BLOCK, "asked": len(hashes), "last_hash": hashes[-1],
        "key_space": SPACE.to_json()}
    # All of it stored: straight to decode, with what makes decode load it.
    lookup.held = set(hashes)
    status, headers, raw = await post(f"{proxy}/v1/completions", body)
    assert status == 200 and json.loads(raw)["choices"][0]["text"] == "d0 loaded"
    assert len(prefill.requests) == 2
    params = decode.requests[-1]["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params[TOKENS_KEY] == len(hashes) * BLOCK <= len(tokens) - 1
    assert params[PREFIX_HASH_KEY] == hashes[-1] and params[IDENTITY_KEY] == IDENTITY
    # Nothing a client receives says what the store held.
    assert not any("store" in name.lower() or "kvhelper" in name.lower() for name in headers)
    text = await metrics(proxy)
    for line in ('disagg_proxy_route_decisions_total{kind="skip_prefill"} 1.0',
                 'disagg_proxy_route_decisions_total{kind="prefill"} 1.0',
                 'disagg_proxy_route_fallbacks_total{reason="not_learned"} 1.0',
                 f"disagg_proxy_prefix_hit_tokens_total {float(len(hashes) * BLOCK + 2 * BLOCK)}"):
        assert line in text, text


async def test_a_salted_prompt_is_hashed_with_its_salt(tokenizer_source, backends, start_proxy):
    lookup = FakeLookup()
    prefill, _, proxy, _ = await routed(tokenizer_source, backends, start_proxy, lookup)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    await post(f"{proxy}/v1/completions", body)  # learn
    _, plain = prompt_hashes(tokenizer_source, body)
    _, salted = prompt_hashes(tokenizer_source, body, salt="tenant-b")
    assert plain[0] != salted[0] and plain[1] != salted[1]  # the chain carries the salt on
    lookup.held = set(plain)
    assert (await post(f"{proxy}/v1/completions", {**body, "cache_salt": "tenant-b"}))[0] == 200
    assert len(prefill.requests) == 2  # another tenant's pages are not its own
    assert lookup.asked[-1][1] == salted


async def test_chat_prompts_use_the_models_chat_template(tokenizer_source, backends,
                                                         start_proxy):
    lookup = FakeLookup()
    prefill, decode, proxy, _ = await routed(tokenizer_source, backends, start_proxy, lookup)
    body = {"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 2}
    await post(f"{proxy}/v1/chat/completions", body)  # learn
    tokens, hashes = prompt_hashes(tokenizer_source, body, chat=True)
    assert len(tokens) > len(PromptTokenizer(tokenizer_source).tokens(False, {"prompt": PROMPT}))
    lookup.held = set(hashes)
    assert (await post(f"{proxy}/v1/chat/completions", body))[0] == 200
    assert len(prefill.requests) == 1 and "kv_transfer_params" in decode.requests[-1]
    # Content parts, tools or an adapter's name: routed as today, and counted.
    parts = {**body, "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}]}
    assert (await post(f"{proxy}/v1/chat/completions", parts))[0] == 200
    assert (await post(f"{proxy}/v1/chat/completions", {**body, "model": "my-lora"}))[0] == 200
    assert len(prefill.requests) == 3
    text = await metrics(proxy)
    assert 'disagg_proxy_route_fallbacks_total{reason="message_content"} 1.0' in text
    assert 'disagg_proxy_route_fallbacks_total{reason="lora"} 1.0' in text


async def test_a_store_that_fails_or_hangs_costs_no_request(tokenizer_source, backends,
                                                            start_proxy):
    lookup = FakeLookup()
    prefill, _, proxy, _ = await routed(tokenizer_source, backends, start_proxy, lookup,
                                        lookup_timeout=0.2)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    await post(f"{proxy}/v1/completions", body)  # learn
    _, hashes = prompt_hashes(tokenizer_source, body)
    lookup.held = set(hashes)
    lookup.fail = True
    assert (await post(f"{proxy}/v1/completions", body))[0] == 200
    assert [str(err) for err in lookup.failures] == ["the store failed"]  # lookups pause
    lookup.fail, lookup.delay = False, 5.0  # hung: the proxy stops waiting after 0.2 s
    started = time.monotonic()
    results = await asyncio.gather(*(post(f"{proxy}/v1/completions", body) for _ in range(6)))
    assert all(status == 200 for status, _, _ in results)
    assert time.monotonic() - started < 3
    assert len(prefill.requests) == 8
    text = await metrics(proxy)
    assert 'disagg_proxy_route_fallbacks_total{reason="lookup_failed"} 1.0' in text
    # Four lookup threads wait on the store; the others do not queue behind them.
    assert 'disagg_proxy_route_fallbacks_total{reason="lookup_timeout"} 4.0' in text
    assert 'disagg_proxy_route_fallbacks_total{reason="lookup_busy"} 2.0' in text


async def test_the_proxy_checks_its_hash_against_prefills(tokenizer_source, backends,
                                                          start_proxy):
    lookup = FakeLookup()
    prefill, _, proxy, router = await routed(tokenizer_source, backends, start_proxy, lookup)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    _, hashes = prompt_hashes(tokenizer_source, body)
    await post(f"{proxy}/v1/completions", body)  # learn
    prefill.prefill_params = (load_from_store(2 * BLOCK, hashes[1], IDENTITY)
                              | {KEY_SPACE_KEY: SPACE.to_json()})
    await post(f"{proxy}/v1/completions", body)
    prefill.prefill_params = (load_from_store(2 * BLOCK, "0" * 64, IDENTITY)
                              | {KEY_SPACE_KEY: SPACE.to_json()})
    await post(f"{proxy}/v1/completions", body)
    text = await metrics(proxy)
    assert 'disagg_proxy_prompt_hash_checks_total{result="agree"} 1.0' in text
    assert 'disagg_proxy_prompt_hash_checks_total{result="disagree"} 1.0' in text


async def two_prefills(tokenizer_source: TokenizerSource, backends: Any, start_proxy: Any,
                       lookup: FakeLookup, **prefill: Any) -> tuple[list[Any], str]:
    """Two prefill instances and one decode behind a store-routing proxy that has learned
    their key space (one request sent)."""
    params = load_from_store(BLOCK, "h", IDENTITY) | {KEY_SPACE_KEY: SPACE.to_json()}
    prefills = [await backends(f"p{i}", prefill_params=params, **prefill) for i in range(2)]
    decode = await backends("d0")
    router = StoreRouter(tokenizer_source, lookup)
    proxy = await start_proxy([], [], discovery=StaticDiscovery(
        [p.url for p in prefills], [decode.url], model="tiny"), router=router)
    await asyncio.wait_for(router.ready.wait(), 60)
    await post(f"{proxy}/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1})
    return prefills, proxy


async def test_prefill_goes_to_the_instance_with_the_fewest_tokens_to_compute(
        tokenizer_source, backends, start_proxy):
    prefills, proxy = await two_prefills(tokenizer_source, backends, start_proxy,
                                         FakeLookup(), prefill_delay=1.0)
    long = {"model": "tiny", "prompt": PROMPT * 4, "max_tokens": 1}
    short = {"model": "tiny", "prompt": "one two", "max_tokens": 1}
    # While one instance computes a long prompt, the short ones all go to the other (by
    # requests in progress, the second short would tie and could land behind the long one).
    first = asyncio.create_task(post(f"{proxy}/v1/completions", long))
    await asyncio.sleep(0.3)
    await asyncio.gather(*(post(f"{proxy}/v1/completions", short) for _ in range(3)))
    await first
    (took_long,) = [p for p in prefills if any(r["prompt"] == long["prompt"]
                                               for r in p.requests)]
    (other,) = [p for p in prefills if p is not took_long]
    assert [r["prompt"] for r in other.requests].count(short["prompt"]) == 3


async def test_a_prompt_goes_to_the_prefill_instance_that_holds_its_prefix(
        tokenizer_source, backends, start_proxy):
    """Of idle prefill instances, the one the proxy last sent a prompt's prefix to gets the
    next prompt that shares it (its own prefix cache holds it; another would load it from
    the store), turn after turn; a prompt sharing nothing is taken in turn as before."""
    lookup = FakeLookup()
    prefills, proxy = await two_prefills(tokenizer_source, backends, start_proxy, lookup)
    history = PROMPT
    for turn in range(4):
        body = {"model": "tiny", "prompt": history, "max_tokens": 1}
        _, hashes = prompt_hashes(tokenizer_source, body)
        lookup.held = set(hashes[:-1])  # all but the newest block: prefill computes it
        assert (await post(f"{proxy}/v1/completions", body))[0] == 200
        history += f" reply{turn} and question{turn} " * 6
    (took,) = [p for p in prefills if any(r["prompt"] == PROMPT for r in p.requests)]
    assert sum(r["prompt"].startswith(PROMPT) for r in took.requests) == 4
    others = [{"model": "tiny", "prompt": f"other {i} " * 40, "max_tokens": 1}
              for i in range(4)]
    for body in others:
        assert (await post(f"{proxy}/v1/completions", body))[0] == 200
    assert all(sum(r["prompt"].startswith("other") for r in p.requests) == 2 for p in prefills)


def test_held_prefixes_count_leading_blocks_and_evict_a_prompts_tail_first() -> None:
    held = HeldPrefixes(capacity_blocks=4)
    held.add(["a", "b", "c"])
    assert held.leading(["a", "b", "c", "d"]) == 3
    assert held.leading(["z", "a", "b"]) == 0  # leading blocks only
    held.add(["x", "y"])  # five blocks: the oldest prompt's last block goes first
    assert held.leading(["a", "b", "c"]) == 2
    assert held.leading(["x", "y"]) == 2


async def test_a_short_unstored_rest_is_computed_by_decode_within_local_prefill_tokens(
        tokenizer_source, backends, start_proxy):
    lookup = FakeLookup()
    prefill, decode, proxy, _ = await routed(tokenizer_source, backends, start_proxy, lookup,
                                             local_prefill_tokens=2 * BLOCK)
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3}
    assert (await post(f"{proxy}/v1/completions", body))[0] == 200  # learns the key space
    tokens, hashes = prompt_hashes(tokenizer_source, body)
    cases = [  # (blocks stored, goes to prefill)
        (len(hashes) - 1, False),  # the rest: one block and the partial last one
        (0, len(tokens) > 2 * BLOCK),
        (len(tokens) // BLOCK - 2, len(tokens) % BLOCK > 0),  # 2 blocks and more: too long
    ]
    for stored, to_prefill in cases:
        lookup.held = set(hashes[:stored])
        prefills = len(prefill.requests)
        assert (await post(f"{proxy}/v1/completions", body))[0] == 200
        assert len(prefill.requests) == prefills + to_prefill, (stored, len(tokens))
        if to_prefill:
            continue
        params = decode.requests[-1].get("kv_transfer_params")
        if stored:
            assert params[TOKENS_KEY] == stored * BLOCK
            assert params[PREFIX_HASH_KEY] == hashes[stored - 1]
        else:  # nothing stored: decode computes the prompt, with nothing to load
            assert params is None
    assert 'disagg_proxy_skip_prefill_computed_tokens_total' in await metrics(proxy)


async def test_a_prompt_the_store_answers_at_once_is_routed_without_yielding_the_loop(
        tokenizer_source):
    """On busy cores the loop's wake-up after a lookup costs a scheduler tick (brief_wait.py):
    an answer that comes within the allowance is taken before the loop runs anything else."""
    lookup = FakeLookup()
    # Generous for a loaded test machine; the proxy's own is 2 ms.
    router = StoreRouter(tokenizer_source, lookup, lookup_timeout=2.0,
                         brief_wait=BriefWait(share=1.0, longest_s=0.5, burst_s=0.5))
    await router.start()
    router.learn("fp", load_from_store(BLOCK, "h", IDENTITY) | {KEY_SPACE_KEY: SPACE.to_json()})
    body = {"model": "tiny", "prompt": list(range(1, 5 * BLOCK)), "max_tokens": 1}
    ran: list[str] = []
    asyncio.get_running_loop().call_soon(ran.append, "other work")
    route, _ = await router.decide(False, body, {"tiny"}, {"fp"})
    assert route.kind == "prefill" and lookup.asked and ran == []
    await asyncio.sleep(0)
    ran.clear()
    # A late answer is awaited as before: the loop serves others meanwhile.
    lookup.delay = 0.8
    asyncio.get_running_loop().call_soon(ran.append, "other work")
    route, _ = await router.decide(False, body, {"tiny"}, {"fp"})
    assert route.kind == "prefill" and ran == ["other work"]
    router.close()
