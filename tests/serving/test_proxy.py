"""The XpYd proxy against test doubles of vLLM's OpenAI server (tests/serving/fake_vllm.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import pytest
from disagg_devtools.processes import free_port
from disagg_devtools.waiting import wait_for
from kvhelper.instances import Instance
from kvhelper.proxy.app import ProxyConfig
from kvhelper.proxy.pool import Pool


async def post(url: str, body: Any, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> tuple[int, Any, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            url, data=raw if raw is not None else json.dumps(body),
            headers={"Content-Type": "application/json", **(headers or {})}) as response:
        return response.status, response.headers.copy(), await response.read()


async def test_prefill_gets_one_token_and_decode_gets_the_kv_params(backends, start_proxy):
    prefill, decode = await backends("p0"), await backends("d0")
    proxy = await start_proxy([prefill.url], [decode.url])
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 5, "min_tokens": 2,
            "stream_options": {"include_usage": True}, "temperature": 0}
    status, headers, raw = await post(f"{proxy}/v1/completions", body,
                                      {"X-Request-Id": "req-42"})
    assert status == 200, raw
    assert json.loads(raw)["choices"][0]["text"] == "d0 loaded"
    (sent_to_prefill,) = prefill.requests
    assert sent_to_prefill["max_tokens"] == 1 and sent_to_prefill["stream"] is False
    assert "stream_options" not in sent_to_prefill and "min_tokens" not in sent_to_prefill
    assert sent_to_prefill["kv_transfer_params"]["do_remote_decode"] is True
    (sent_to_decode,) = decode.requests
    assert sent_to_decode["max_tokens"] == 5 and sent_to_decode["min_tokens"] == 2
    assert sent_to_decode["kv_transfer_params"]["remote_engine_id"] == "p0"
    assert prefill.headers[0]["X-Request-Id"] == decode.headers[0]["X-Request-Id"] == "req-42"
    assert headers["X-Request-Id"] == "req-42"


async def test_chat_streaming_is_passed_through(backends, start_proxy):
    prefill, decode = await backends("p0"), await backends("d0", tokens=3)
    proxy = await start_proxy([prefill.url], [decode.url])
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3, "stream": True}
    status, headers, raw = await post(f"{proxy}/v1/chat/completions", body)
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in raw.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]" and len(events) == 4
    assert prefill.requests[0]["max_completion_tokens"] == 1
    assert decode.requests[0]["max_completion_tokens"] == 3
    assert headers["X-Request-Id"].startswith("disagg-")


async def test_refused_prefill_is_retried_once_on_another(backends, start_proxy):
    live, decode = await backends("p1"), await backends("d0")
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy([dead, live.url], [decode.url])
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200, raw
    assert len(live.requests) == 1


async def test_every_failure_is_an_http_error_with_a_json_body(backends, start_proxy):
    refusing_prefill = await backends("p0", fail_status=400)
    failing_decode = await backends("d0", fail_status=500)
    ok_prefill = await backends("p1")
    dead = f"http://127.0.0.1:{free_port()}"
    cases = [
        ([refusing_prefill.url], [failing_decode.url], 400, "p0 refuses"),
        ([ok_prefill.url], [failing_decode.url], 500, "d0 refuses"),
        ([ok_prefill.url], [dead], 502, "refused the connection"),
        ([dead], [failing_decode.url], 502, "refused the connection"),
    ]
    for prefill, decode, code, text in cases:
        proxy = await start_proxy(prefill, decode)
        status, headers, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
        assert status == code, raw
        assert headers["Content-Type"].startswith("application/json")
        assert text in json.loads(raw)["error"]["message"]


async def test_bad_bodies_get_4xx_json(backends, start_proxy):
    prefill, decode = await backends("p0"), await backends("d0")
    proxy = await start_proxy([prefill.url], [decode.url], max_body_bytes=1024)
    for raw, code in ((b"{not json", 400), (b"[1, 2]", 400), (b'{"stream": "yes"}', 400),
                      (b'{"prompt": "' + b"x" * 4096 + b'"}', 413)):
        status, _, body = await post(f"{proxy}/v1/completions", None, raw=raw)
        assert status == code, body
        assert json.loads(body)["error"]["code"] == code
    assert prefill.requests == [] and decode.requests == []


async def test_decode_dying_mid_stream_ends_the_stream_with_an_error(backends, start_proxy):
    prefill, decode = await backends("p0"), await backends("d0", tokens=10, die_after_tokens=2)
    proxy = await start_proxy([prefill.url], [decode.url])
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x", "stream": True})
    assert status == 200  # the headers were sent before decode died
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert len(events) == 3 and "[DONE]" not in events  # two tokens, then the error
    assert json.loads(events[-1])["error"]["code"] == 502  # the stream's last event
    # The dropped stream ejected the only decode instance: nothing is left to serve.
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert status == 503, raw
    fresh = await start_proxy([prefill.url], [decode.url])
    status, _, raw = await post(f"{fresh}/v1/completions", {"prompt": "x"})
    assert status == 502 and "decode instance" in json.loads(raw)["error"]["message"]


def _events(raw: bytes) -> list[str]:
    return [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]


def _streamed_text(events: list[str], chat: bool) -> str:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return "".join((c["choices"][0]["delta"].get("content") or "") if chat
                   else c["choices"][0]["text"] for c in chunks if c.get("choices"))


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
async def test_a_stream_whose_decode_dies_goes_on_elsewhere_with_the_same_tokens(
        backends, start_proxy, chat):
    """The decode instance serving a stream dies after 3 of 8 tokens reached the client. The
    proxy continues it on another decode instance from the prompt's and the tokens' ids: the
    client gets one stream, the same text an uninterrupted one gives, and no token ids it did
    not ask for."""
    from disagg_devtools.stand_in_model import expected_text, prompt_ids

    prefill = await backends("p0")
    dying, healthy = await backends("d0", die_after_tokens=3), await backends("d1")
    proxy = await start_proxy([prefill.url], [dying.url, healthy.url])
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict[str, Any] = {"model": "tiny", "stream": True, "temperature": 0,
                            **({"messages": [{"role": "user", "content": "hi there"}],
                                "max_completion_tokens": 8} if chat
                               else {"prompt": "hi there", "max_tokens": 8})}
    status, _, raw = await post(f"{proxy}{path}", body)
    assert status == 200
    events = _events(raw)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    assert not any("error" in json.loads(e) for e in events[:-1]), events
    assert _streamed_text(events, chat) == expected_text(body, 8)
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {f"{'chatcmpl' if chat else 'cmpl'}-d0"}
    assert all("token_ids" not in c["choices"][0] and "prompt_token_ids" not in c
               for c in chunks)
    (continuation,) = healthy.requests  # the prompt's ids and the 3 tokens streamed
    assert continuation["prompt"] == dying.streamed_ids[0]
    assert len(continuation["prompt"]) == len(prompt_ids(body)) + 3
    assert continuation["max_tokens"] == 5 and "kv_transfer_params" not in continuation
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/metrics") as answer:
        page = await answer.read()
    assert b'disagg_proxy_stream_continuations_total{result="continued"} 1.0' in page


async def test_a_stream_is_not_continued_where_its_rest_cannot_be_reproduced(
        backends, start_proxy):
    """Stop strings (vLLM holds back text that may start one), continuation turned off, or no
    instance left: the stream ends with an error event, as before."""
    prefill = await backends("p0")
    dying, healthy = await backends("d0", die_after_tokens=2), await backends("d1")
    proxy = await start_proxy([prefill.url], [dying.url, healthy.url])
    body = {"prompt": "x", "stream": True, "max_tokens": 6, "stop": ["."]}
    _, _, raw = await post(f"{proxy}/v1/completions", body)
    assert json.loads(_events(raw)[-1])["error"]["code"] == 502 and healthy.requests == []
    off = await start_proxy([prefill.url], [dying.url, healthy.url], continue_streams=False)
    _, _, raw = await post(f"{off}/v1/completions", {**body, "stop": None})
    assert json.loads(_events(raw)[-1])["error"]["code"] == 502 and healthy.requests == []
    both_die = await backends("d2", die_after_tokens=1)
    alone = await start_proxy([prefill.url], [dying.url, both_die.url])
    _, _, raw = await post(f"{alone}/v1/completions", {**body, "stop": None})
    events = _events(raw)
    assert json.loads(events[-1])["error"]["code"] == 502 and "[DONE]" not in events


async def test_token_ids_a_client_asks_for_reach_it_through_a_continuation(
        backends, start_proxy):
    prefill = await backends("p0")
    dying, healthy = await backends("d0", die_after_tokens=2), await backends("d1")
    proxy = await start_proxy([prefill.url], [dying.url, healthy.url])
    body = {"prompt": "abc", "stream": True, "max_tokens": 5, "return_token_ids": True}
    _, _, raw = await post(f"{proxy}/v1/completions", body)
    chunks = [json.loads(e) for e in _events(raw) if e != "[DONE]"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == [ord(c) for c in "abc"]
    ids = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert ids == dying.streamed_ids[0][3:5] + healthy.streamed_ids[0][5:]
    assert len(ids) == 5


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_client_disconnect_aborts_the_instance_request(backends, start_proxy, phase):
    prefill = await backends("p0", prefill_delay=30.0 if phase == "prefill" else 0.0)
    decode = await backends("d0", tokens=100, token_delay=0.2)
    proxy = await start_proxy([prefill.url], [decode.url])
    target = prefill if phase == "prefill" else decode
    async with aiohttp.ClientSession() as session:
        if phase == "decode":
            response = await session.post(f"{proxy}/v1/completions",
                                          json={"prompt": "x", "stream": True})
            await response.content.readuntil(b"\n\n")  # one token arrived, then we leave
            response.close()
        else:
            pending = asyncio.create_task(session.post(f"{proxy}/v1/completions",
                                                       json={"prompt": "x", "stream": True}))
            await wait_for(lambda: prefill.requests, 10, "prefill to start")
            pending.cancel()  # the client gives up while prefill runs
    await asyncio.wait_for(target.aborted.wait(), 10)
    assert phase == "decode" or decode.requests == []  # nothing was sent on to decode


async def test_unhealthy_instances_are_ejected_and_readmitted(backends, start_proxy):
    prefill = await backends("p0")
    good, bad = await backends("d0"), await backends("d1", healthy=False)
    proxy = await start_proxy([prefill.url], [good.url, bad.url], health_interval=0.1,
                              eject_after=1)

    async def instances() -> dict[str, bool]:
        async with aiohttp.ClientSession() as session, session.get(
                f"{proxy}/instances") as response:
            return {i["url"]: i["healthy"] for i in await response.json()}

    state: dict[str, bool] = {}

    async def refresh() -> None:
        state.update(await instances())

    for _ in range(100):
        await refresh()
        if state.get(bad.url) is False:
            break
        await asyncio.sleep(0.05)
    assert state == {prefill.url: True, good.url: True, bad.url: False}
    for _ in range(4):
        assert (await post(f"{proxy}/v1/completions", {"prompt": "x"}))[0] == 200
    assert len(good.requests) == 4 and bad.requests == []
    bad.healthy = True
    for _ in range(100):
        await refresh()
        if state.get(bad.url):
            break
        await asyncio.sleep(0.05)
    assert state[bad.url] is True


async def test_health_and_metrics_endpoints(backends, start_proxy):
    prefill, decode = await backends("p0"), await backends("d0")
    proxy = await start_proxy([prefill.url], [decode.url])
    await post(f"{proxy}/v1/completions", {"prompt": "x"})
    await post(f"{proxy}/v1/completions", {"max_tokens": 1})  # no prompt: not an arrival
    async with aiohttp.ClientSession() as session:
        for made_up in ("/a", "/b/c"):  # unknown paths share one series, not one each
            async with session.get(f"{proxy}{made_up}") as response:
                assert response.status == 404
        async with session.get(f"{proxy}/health") as response:
            assert response.status == 200
            assert (await response.json())["healthy"] == {"prefill": 1, "decode": 1}
        async with session.get(f"{proxy}/metrics") as response:
            text = await response.text()
        async with session.get(f"{proxy}/v1/models") as response:
            assert (await response.json())["data"][0]["id"] == "tiny"
    assert 'disagg_proxy_requests_total{code="200",endpoint="/v1/completions"} 1.0' in text
    assert 'disagg_proxy_requests_total{code="404",endpoint="unmatched"} 2.0' in text
    assert "disagg_proxy_phase_seconds_count" in text
    assert "disagg_proxy_requests_arrived_total 1.0" in text  # the planner's arrival rate


def test_routing_policies_and_fingerprint_pairing() -> None:
    def inst(name: str, role: str, fingerprint: str = "") -> Instance:
        return Instance(id=name, role=role, url=f"http://{name}", model="m",  # type: ignore[arg-type]
                        fingerprint=fingerprint)

    pool = Pool(routing="round-robin")
    pool.update({"a": inst("a", "decode", "F1"), "b": inst("b", "decode", "F2"),
                 "c": inst("c", "decode", "F1")})
    assert [pool.pick("decode").url for _ in range(3)] == ["http://a", "http://b", "http://c"]
    assert {pool.pick("decode", "F1").url for _ in range(4)} == {"http://a", "http://c"}
    assert pool.pick("decode", "F3") is None
    least = Pool(routing="least-outstanding")
    least.update({"a": inst("a", "decode"), "b": inst("b", "decode")})
    least.backends["a"].outstanding = 3
    assert least.pick("decode").url == "http://b"
    kept = least.backends["a"]
    least.update({"a": inst("a", "decode")})
    assert least.backends["a"] is kept  # membership updates keep health and load state


async def test_phase_timeouts_and_the_concurrency_limit(backends, start_proxy):
    slow_prefill = await backends("p0", prefill_delay=5.0)
    decode = await backends("d0", tokens=50, token_delay=0.1)
    proxy = await start_proxy([slow_prefill.url], [decode.url], prefill_timeout=0.3)
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert status == 504 and "did not answer within 0.3s" in json.loads(raw)["error"]["message"]

    fast_prefill = await backends("p1")
    limited = await start_proxy([fast_prefill.url], [decode.url], max_concurrency=1)
    async with aiohttp.ClientSession() as session:
        first = await session.post(f"{limited}/v1/completions",
                                   json={"prompt": "x", "stream": True})
        await first.content.readuntil(b"\n\n")  # the only slot is taken
        status, _, raw = await post(f"{limited}/v1/completions", {"prompt": "y"})
        first.close()
    assert status == 429 and json.loads(raw)["error"]["type"] == "rate_limit_error"


def test_flags_come_from_the_environment_too(monkeypatch) -> None:
    from kvhelper.proxy.__main__ import parse_args

    monkeypatch.setenv("DISAGG_PROXY_PREFILL", "p1:8000,p2:8000")
    monkeypatch.setenv("DISAGG_PROXY_DECODE", "d1:8000")
    monkeypatch.setenv("DISAGG_PROXY_DECODE_TIMEOUT", "900")
    args = parse_args(["--routing", "least-outstanding"])
    assert args.prefill == ["p1:8000", "p2:8000"] and args.decode == ["d1:8000"]
    assert args.decode_timeout == 900.0 and args.routing == "least-outstanding"


def test_least_outstanding_breaks_ties_in_turn() -> None:
    pool = Pool(routing="least-outstanding")
    pool.update({name: Instance(id=name, role="decode", url=f"http://{name}", model="m")
                 for name in ("a", "b", "c")})
    assert [pool.pick("decode").url for _ in range(6)] == ["http://a", "http://b", "http://c"] * 2
    pool.backends["b"].outstanding = 1
    assert {pool.pick("decode").url for _ in range(4)} == {"http://a", "http://c"}


@pytest.mark.parametrize("routing", ["round-robin", "least-outstanding"])
async def test_a_dead_decode_costs_no_client_request(backends, start_proxy, routing):
    """A decode instance that refuses connections is retried elsewhere and ejected at once,
    without waiting for a health check (the interval here is a minute)."""
    prefill, live = await backends("p0"), await backends("d0")
    dead = f"http://127.0.0.1:{free_port()}"
    proxy = await start_proxy([prefill.url], [dead, live.url], routing=routing)
    for _ in range(6):
        status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
        assert status == 200, raw
    assert len(live.requests) == 6
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/instances") as got:
        assert {i["url"]: i["healthy"] for i in await got.json()}[dead] is False
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/metrics") as got:
        assert 'disagg_proxy_retries_total{phase="decode"} 1.0' in await got.text()


@pytest.mark.parametrize("failure", ["503", "closed"])
async def test_decode_failing_before_its_first_byte_is_retried_with_the_same_kv_params(
        backends, start_proxy, failure):
    prefill = await backends("p0")
    failing = await backends("d0", **({"fail_status": 503} if failure == "503"
                                      else {"die_after_tokens": 0}))
    good = await backends("d1")
    proxy = await start_proxy([prefill.url], [failing.url, good.url])
    for stream in (False, True):
        status, _, raw = await post(f"{proxy}/v1/completions",
                                    {"prompt": "x", "stream": stream, "max_tokens": 4})
        assert status == 200, raw
        assert b"d1" in raw or b"t3" in raw
    assert len(failing.requests) >= 1 and len(good.requests) == 2
    assert failing.requests[0]["kv_transfer_params"] == good.requests[0]["kv_transfer_params"]


@pytest.mark.parametrize("phase", ["prefill", "decode"])
async def test_a_kept_alive_connection_the_instance_closed_costs_no_request(
        backends, start_proxy, phase):
    """An instance that closes an idle kept-alive connection just as the proxy sends a request
    on it (vLLM closes them after 5 s) is not down: the request goes again on a new connection
    to the same instance, which stays in the pool, even when it is the only one of its role."""
    prefill = await backends("p0", drop_reused=phase == "prefill")
    decode = await backends("d0", drop_reused=phase == "decode")
    proxy = await start_proxy([prefill.url], [decode.url])
    for stream in (False, True, False, True):
        status, _, raw = await post(f"{proxy}/v1/completions",
                                    {"prompt": "x", "stream": stream, "max_tokens": 4})
        assert status == 200, raw
    assert (prefill if phase == "prefill" else decode).dropped >= 1  # the race happened
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/instances") as got:
        assert all(i["healthy"] for i in await got.json())
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/metrics") as got:
        text = await got.text()
    assert f'disagg_proxy_reconnects_total{{phase="{phase}"}} ' in text, text


async def test_health_checks_never_go_out_on_a_connection_the_instance_may_have_closed(
        backends, start_proxy):
    """A check every 5 s on a connection vLLM closes after 5 s idle would race its close: each
    check goes on a new connection, so an instance that drops reused ones stays in the pool."""
    prefill = await backends("p0", drop_reused=True)
    decode = await backends("d0", drop_reused=True)
    proxy = await start_proxy([prefill.url], [decode.url], health_interval=0.05,
                              health_timeout=0.04, eject_after=1)
    await wait_for(lambda: len(decode.connections) >= 10, 10, "ten health checks")
    assert decode.dropped == 0 and prefill.dropped == 0
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert status == 200, raw


async def test_an_idle_connection_is_not_reused_past_the_upstream_keep_alive(
        backends, start_proxy):
    """The proxy gives up an idle connection before the instance would close it (vLLM: 5 s),
    so that race is rare to begin with; within the limit, connections are reused."""
    from vllm import envs

    assert ProxyConfig().upstream_keepalive < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    prefill, decode = await backends("p0"), await backends("d0")
    proxy = await start_proxy([prefill.url], [decode.url], upstream_keepalive=0.3)
    await post(f"{proxy}/v1/completions", {"prompt": "x"})
    await asyncio.sleep(1.0)  # idle past the limit: the behaviour under test, not a wait
    await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert decode.connections[0] != decode.connections[1]


async def test_a_frozen_decode_is_given_up_after_the_first_byte_limit(backends, start_proxy):
    prefill = await backends("p0")
    frozen, good = await backends("d0", frozen=True), await backends("d1")
    proxy = await start_proxy([prefill.url], [frozen.url, good.url],
                              decode_first_byte_timeout=0.5)
    started = asyncio.get_running_loop().time()
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x", "stream": True})
    waited = asyncio.get_running_loop().time() - started
    assert status == 200 and b"[DONE]" in raw, raw
    assert len(frozen.requests) == 1 and len(good.requests) == 1
    assert waited < 3, waited  # the first-byte limit plus one retry, not the silence limit


async def test_an_ejected_decode_gives_up_its_waiting_requests(backends, start_proxy):
    """A non-streaming request has no first-byte limit (its answer comes whole), but when a
    health check ejects the frozen instance, its waiting requests go to another one."""
    prefill = await backends("p0")
    frozen, good = await backends("d0", frozen=True), await backends("d1")
    proxy = await start_proxy([prefill.url], [frozen.url, good.url], health_interval=0.2,
                              health_timeout=0.1, eject_after=1)
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert status == 200 and b"d1" in raw, raw
    assert len(frozen.requests) == 1


async def test_the_last_decode_too_busy_for_its_health_check_keeps_its_requests(
        backends, start_proxy):
    """Found running the pods as containers: with one decode killed, the other, busy on two
    cores, answered its health checks late; ejecting it gave up every request it was serving
    (504) with nowhere else to send them. A late answer from the last healthy instance of a
    role does not eject it; an answer that says unhealthy, or a refused connection, does."""
    prefill = await backends("p0")
    busy = await backends("d0", tokens=3, token_delay=0.4, health_delay=0.3)
    dead = await backends("d1", healthy=False)
    proxy = await start_proxy([prefill.url], [busy.url, dead.url], health_interval=0.15,
                              health_timeout=0.1, eject_after=1)
    statuses = await asyncio.gather(*(post(f"{proxy}/v1/completions", {"prompt": "x"})
                                      for _ in range(3)))
    assert [s[0] for s in statuses] == [200, 200, 200], statuses
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/instances") as got:
        healthy = {i["url"]: i["healthy"] for i in await got.json()}
    assert healthy == {prefill.url: True, busy.url: True, dead.url: False}
    assert len(busy.requests) == 3


async def test_no_prefill_is_spent_on_a_request_no_decode_can_take(backends, start_proxy):
    prefill = await backends("p0")
    unhealthy = await backends("d0", healthy=False)
    proxy = await start_proxy([prefill.url], [unhealthy.url], health_interval=0.1,
                              eject_after=1)
    async with aiohttp.ClientSession() as session:
        for _ in range(100):  # until the health check ejected the only decode instance
            async with session.get(f"{proxy}/instances") as got:
                if not {i["url"]: i["healthy"] for i in await got.json()}[unhealthy.url]:
                    break
            await asyncio.sleep(0.05)
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert status == 503 and "no healthy decode" in json.loads(raw)["error"]["message"]
    fine = await start_proxy([prefill.url], [(await backends("d1")).url])
    for body, field in (({"prompt": "x", "max_tokens": -1}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": True}, "max_tokens"),
                        ({"max_tokens": 3}, "prompt")):
        status, _, raw = await post(f"{fine}/v1/completions", body)
        assert status == 400 and f"`{field}`" in json.loads(raw)["error"]["message"], raw
    status, _, raw = await post(f"{fine}/v1/chat/completions", {"messages": []})
    assert status == 400 and "`messages`" in json.loads(raw)["error"]["message"]
    assert prefill.requests == []


async def test_method_not_allowed_names_the_allowed_methods_and_silence_is_a_timeout(
        backends, start_proxy):
    prefill = await backends("p0")
    slow = await backends("d0", tokens=5, token_delay=2.0)
    proxy = await start_proxy([prefill.url], [slow.url], decode_timeout=0.3)
    async with aiohttp.ClientSession() as session, session.get(
            f"{proxy}/v1/completions") as response:
        assert response.status == 405 and "POST" in response.headers["Allow"]
    # Silence after the first token: the stream's error event says 504 timeout, as the same
    # silence before the headers does.
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x", "stream": True})
    events = [line.removeprefix("data: ") for line in raw.decode().split("\n\n") if line]
    assert status == 200 and json.loads(events[-1])["error"]["code"] == 504, events
    assert json.loads(events[-1])["error"]["type"] == "timeout"


async def test_api_keys_for_clients_and_for_instances(backends, start_proxy, caplog):
    prefill = await backends("p0", api_key="instances-key")
    decode = await backends("d0", api_key="instances-key")
    # Without a key of its own, the proxy passes the client's Authorization on.
    open_proxy = await start_proxy([prefill.url], [decode.url])
    status, _, _ = await post(f"{open_proxy}/v1/completions", {"prompt": "x"},
                              {"Authorization": "Bearer instances-key"})
    assert status == 200
    status, _, raw = await post(f"{open_proxy}/v1/completions", {"prompt": "x"})
    assert status == 401, raw
    # With keys: clients present the proxy's; the instances get theirs.
    guarded = await start_proxy([prefill.url], [decode.url], api_key="clients-key",
                                backend_api_key="instances-key")
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        status, _, raw = await post(f"{guarded}/v1/completions", {"prompt": "x"}, headers)
        assert status == 401 and json.loads(raw)["error"]["type"] == "authentication_error"
    sent = len(prefill.requests)
    status, _, raw = await post(f"{guarded}/v1/completions", {"prompt": "x"},
                                {"Authorization": "Bearer clients-key"})
    assert status == 200, raw
    assert prefill.headers[-1]["Authorization"] == "Bearer instances-key"
    assert len(prefill.requests) == sent + 1
    async with aiohttp.ClientSession() as session, session.get(f"{guarded}/health") as got:
        assert got.status == 200  # probes need no key
    assert "clients-key" not in caplog.text and "instances-key" not in caplog.text


def test_api_keys_come_only_from_the_environment(monkeypatch) -> None:
    from kvhelper.proxy.__main__ import parse_args

    monkeypatch.setenv("DISAGG_PROXY_API_KEY", "k1")
    monkeypatch.setenv("DISAGG_PROXY_BACKEND_API_KEY", "k2")
    config = parse_args(["--prefill", "p:1", "--decode", "d:1"]).config
    assert (config.api_key, config.backend_api_key) == ("k1", "k2")
    assert "k1" not in repr(config) and "k2" not in repr(config)
    with pytest.raises(SystemExit):
        parse_args(["--prefill", "p:1", "--decode", "d:1", "--api-key", "k1"])


async def test_idle_and_half_sent_connections_are_closed_and_connections_are_capped(
        backends) -> None:
    from kvhelper.discovery import StaticDiscovery
    from kvhelper.proxy.app import Proxy, ProxyConfig
    from kvhelper.proxy.server import serve

    prefill, decode = await backends("p0"), await backends("d0")
    proxy = Proxy(ProxyConfig(health_interval=60.0), StaticDiscovery([prefill.url],
                                                                      [decode.url]))
    port = free_port()
    runner, listener = await serve(proxy.app(), "127.0.0.1", port, idle_timeout=0.5,
                                   max_connections=2)
    try:
        idle = await asyncio.open_connection("127.0.0.1", port)
        half = await asyncio.open_connection("127.0.0.1", port)
        half[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finished
        await half[1].drain()
        await wait_for(lambda: len(runner.server.connections) == 2, 5, "both accepted")
        extra_reader, _ = await asyncio.open_connection("127.0.0.1", port)
        refused = await asyncio.wait_for(extra_reader.read(), 5)
        assert refused.startswith(b"HTTP/1.1 503") and b"connection limit" in refused
        # Both are closed by the idle timeout; the proxy serves again.
        for reader, _ in (idle, half):
            assert await asyncio.wait_for(reader.read(), 5) == b""
        status, _, raw = await post(f"http://127.0.0.1:{port}/v1/completions",
                                    {"prompt": "x"})
        assert status == 200, raw
    finally:
        listener.close()
        await runner.cleanup()


class SettableDiscovery:
    """Instances with fingerprints that a test changes while the proxy runs, as registrars do
    during a rollout."""

    def __init__(self, instances: list[Instance]) -> None:
        self.instances = instances
        self._listener: Any = None

    def set(self, instances: list[Instance]) -> None:
        self.instances = instances
        self._listener({i.id: i for i in instances})

    async def run(self, listener: Any, stop: asyncio.Event) -> None:
        self._listener = listener
        listener({i.id: i for i in self.instances})
        await stop.wait()


def fingerprinted(fake: Any, role: str, fingerprint: str) -> Instance:
    return Instance(id=fake.name, role=role, url=fake.url, model="m",  # type: ignore[arg-type]
                    fingerprint=fingerprint)


async def test_a_request_no_pair_can_serve_is_computed_by_decode_alone(backends, start_proxy):
    """Mid-rollout, the prefill instances left may have no decode of their fingerprint, or the
    KV's decode instances may be gone once prefill answers: a decode instance then computes
    the prompt itself, never loading another fingerprint's KV, and the client gets an answer."""
    old_prefill, new_decode = await backends("p-old"), await backends("d-new")
    discovery = SettableDiscovery([fingerprinted(old_prefill, "prefill", "OLD"),
                                   fingerprinted(new_decode, "decode", "NEW")])
    proxy = await start_proxy([], [], discovery=discovery)
    status, _, raw = await post(f"{proxy}/v1/completions", {"prompt": "x"})
    assert status == 200 and b"d-new recomputed" in raw, raw
    assert old_prefill.requests == []
    assert "kv_transfer_params" not in new_decode.requests[-1]

    # Prefill answers for OLD after OLD's decode instance has been withdrawn.
    slow_prefill, old_decode = (await backends("p-slow", prefill_delay=0.5),
                                await backends("d-old"))
    discovery.set([fingerprinted(slow_prefill, "prefill", "OLD"),
                   fingerprinted(old_decode, "decode", "OLD"),
                   fingerprinted(new_decode, "decode", "NEW")])
    answer = asyncio.ensure_future(post(f"{proxy}/v1/completions", {"prompt": "y"}))
    await wait_for(lambda: slow_prefill.requests, timeout=5, what="the prefill request")
    discovery.set([fingerprinted(slow_prefill, "prefill", "OLD"),
                   fingerprinted(new_decode, "decode", "NEW")])
    status, _, raw = await answer
    assert status == 200 and b"d-new recomputed" in raw, raw
    assert old_decode.requests == []
    assert "kv_transfer_params" not in new_decode.requests[-1]
    async with aiohttp.ClientSession() as session, session.get(f"{proxy}/metrics") as got:
        text = await got.text()
    for reason in ("no_compatible_prefill", "no_compatible_decode"):
        assert f'disagg_proxy_decode_alone_total{{reason="{reason}"}} 1.0' in text, reason
