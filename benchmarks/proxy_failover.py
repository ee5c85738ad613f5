"""Benchmark: what one failed decode instance costs the proxy's clients.

The real proxy (`python -m kvhelper.proxy`, its default health settings: a check every 5 s,
ejection after 2 failures) runs in front of 2 prefill and 3 decode stand-ins for vLLM's OpenAI
server (each its own process, named as such: prefill answers kv_transfer_params, decode streams
`--tokens` chunks `--token-delay` apart). A load generator keeps `--concurrency` streaming
requests in flight for `--seconds`; at `--event-at` one decode process is killed (SIGKILL) or
frozen (SIGSTOP). The decode stand-ins run a deterministic stand-in model
(disagg_devtools.stand_in_model) and stream token ids, so the proxy can continue a stream that
breaks on another instance, and the client can check every answer against the uninterrupted
one. Per scenario and routing policy it prints the requests sent, those that failed (an HTTP
error, or a stream without its [DONE]), those that failed before any token reached the client,
those whose text differs from the uninterrupted answer (wrong), the longest a client waited
for its first token, and the seconds after the failure in which fewer than half as many
requests finished as in an average second before it. `--proxy-arg=--no-continue-streams`
shows the proxy that ends a broken stream with an error event. Bounded by --seconds per
scenario.

    .venv-serving/bin/python benchmarks/proxy_failover.py
    .venv-serving/bin/python benchmarks/proxy_failover.py --seconds 20 --event-at 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import IO

import aiohttp
from disagg_devtools.processes import exit_on_sigterm, free_port
from disagg_devtools.stand_in_model import expected_text, next_token, prompt_ids, token_text

SCENARIOS = ("kill", "freeze")
ROUTINGS = ("round-robin", "least-outstanding")


def serve_backend(port: int, tokens: int, token_delay: float) -> None:
    """A stand-in for vLLM's OpenAI server (prefill answers, decode streams the stand-in
    model's tokens, with their ids when asked)."""
    from aiohttp import web

    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if (body.get("kv_transfer_params") or {}).get("do_remote_decode"):
            return web.json_response({"choices": [{"index": 0, "text": "x"}],
                                      "kv_transfer_params": {"do_remote_prefill": True}})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        prompt = prompt_ids(body)
        ids, count = list(prompt), int(body.get("max_tokens") or tokens)
        for i in range(count):
            await asyncio.sleep(token_delay)
            token = next_token(ids)
            ids.append(token)
            choice: dict[str, object] = {"index": 0, "text": token_text(token),
                                         "finish_reason": "length" if i == count - 1 else None}
            if body.get("return_token_ids"):
                choice["token_ids"] = [token]
                if i == 0:
                    choice["prompt_token_ids"] = prompt
            chunk = json.dumps({"id": "cmpl-1", "created": 1, "choices": [choice]})
            await response.write(f"data: {chunk}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


@dataclass
class Outcome:
    ok: bool
    streamed: bool  # at least one token reached the client
    first_token_wait: float
    detail: str = ""  # what the client saw when it failed
    wrong: bool = False  # finished, with other text than the uninterrupted answer
    ended: float = 0.0  # when it ended, in seconds from the load's start


@dataclass
class Result:
    scenario: str
    routing: str
    outcomes: list[Outcome] = field(default_factory=list)
    event_at: float = 0.0

    @property
    def slow_seconds(self) -> int:
        """Whole seconds after the failure in which fewer than half as many requests finished
        as in an average second before it: how long the failure cost the other instances'
        traffic too."""
        before = [o for o in self.outcomes if o.ended < self.event_at]
        if not before or self.event_at < 1:
            return 0
        rate = len(before) / self.event_at
        last = int(max(o.ended for o in self.outcomes))
        bins = [0] * (last + 1)
        for o in self.outcomes:
            bins[int(o.ended)] += o.ok
        return sum(1 for second in range(int(self.event_at), last)
                   if bins[second] < rate / 2)

    @property
    def failed(self) -> int:
        return sum(not o.ok for o in self.outcomes)

    @property
    def wrong(self) -> int:
        return sum(o.wrong for o in self.outcomes)

    @property
    def failed_before_streaming(self) -> int:
        return sum(not o.ok and not o.streamed for o in self.outcomes)

    @property
    def longest_first_token_wait(self) -> float:
        return max((o.first_token_wait for o in self.outcomes), default=0.0)


def wait_listening(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port}")


@contextmanager
def processes(routing: str, tokens: int, token_delay: float, proxy_args: list[str],
              log: int | IO[bytes] = subprocess.DEVNULL
              ) -> Iterator[tuple[int, list[subprocess.Popen[bytes]]]]:
    """The backends and the proxy; yields the proxy's port and the decode processes."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        ports = {role: [free_port() for _ in range(count)]
                 for role, count in (("prefill", 2), ("decode", 3))}
        for port in ports["prefill"] + ports["decode"]:
            started.append(subprocess.Popen(
                [sys.executable, __file__, "--serve", str(port), "--tokens", str(tokens),
                 "--token-delay", str(token_delay)]))
        proxy_port = free_port()
        started.append(subprocess.Popen(
            [sys.executable, "-m", "kvhelper.proxy", "--host", "127.0.0.1",
             "--port", str(proxy_port), "--routing", routing,
             "--prefill", *(f"127.0.0.1:{p}" for p in ports["prefill"]),
             "--decode", *(f"127.0.0.1:{p}" for p in ports["decode"]), *proxy_args],
            stdout=subprocess.DEVNULL, stderr=log))
        deadline = time.monotonic() + 30
        for port in ports["prefill"] + ports["decode"] + [proxy_port]:
            wait_listening(port, deadline)
        yield proxy_port, started[2:5]
    finally:
        for process in started:
            process.send_signal(signal.SIGCONT)
            process.kill()
            process.wait()


async def one_request(session: aiohttp.ClientSession, url: str, number: int,
                      tokens: int) -> Outcome:
    started = time.monotonic()
    first: float | None = None
    done = False
    detail = "no [DONE]"
    body = {"prompt": f"request {number}", "stream": True, "max_tokens": tokens}
    text = ""
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                return Outcome(False, False, time.monotonic() - started,
                               f"{response.status} {(await response.read())[:300]!r}")
            async for line in response.content:
                if not line.startswith(b"data: "):
                    continue
                if first is None:
                    first = time.monotonic() - started
                if line.startswith(b"data: [DONE]"):
                    done = True
                elif b'"error"' in line:
                    detail = line[:300].decode(errors="replace")
                    break
                else:
                    text += json.loads(line[6:])["choices"][0]["text"]
    except (aiohttp.ClientError, TimeoutError) as err:
        detail = repr(err)
    streamed = first is not None
    return Outcome(done, streamed, first if first is not None else time.monotonic() - started,
                   "" if done else detail, wrong=done and text != expected_text(body, tokens))


async def load(proxy_port: int, seconds: float, concurrency: int, event_at: float,
               event: Callable[[], None], tokens: int) -> list[Outcome]:
    url = f"http://127.0.0.1:{proxy_port}/v1/completions"
    outcomes: list[Outcome] = []
    stop_at = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=seconds + 60)

    began = time.monotonic()

    async def worker(session: aiohttp.ClientSession) -> None:
        while time.monotonic() < stop_at:
            outcome = await one_request(session, url, len(outcomes), tokens)
            outcome.ended = time.monotonic() - began
            outcomes.append(outcome)

    async def trigger() -> None:
        await asyncio.sleep(event_at)
        event()

    async with aiohttp.ClientSession(timeout=timeout) as session:
        await asyncio.gather(trigger(), *(worker(session) for _ in range(concurrency)))
    return outcomes


def run(scenario: str, routing: str, seconds: float, event_at: float, concurrency: int,
        tokens: int, token_delay: float, proxy_args: list[str],
        log: int | IO[bytes] = subprocess.DEVNULL) -> Result:
    with processes(routing, tokens, token_delay, proxy_args, log) as (proxy_port, decodes):
        victim = decodes[0]

        def event() -> None:
            victim.send_signal(signal.SIGKILL if scenario == "kill" else signal.SIGSTOP)

        outcomes = asyncio.run(load(proxy_port, seconds, concurrency, event_at, event, tokens))
    return Result(scenario, routing, outcomes, event_at)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=16.0, help="load per scenario")
    parser.add_argument("--event-at", type=float, default=8.0,
                        help="seconds into the load when the decode instance fails")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--token-delay", type=float, default=0.02)
    parser.add_argument("--first-byte-timeout", type=float, default=2.0,
                        help="the proxy's --decode-first-byte-timeout (0: leave it out, for "
                             "a proxy that has no such flag)")
    parser.add_argument("--proxy-log", help="append the proxy's log to this file")
    parser.add_argument("--proxy-arg", action="append", default=[],
                        help="one more argument for the proxy, e.g. --proxy-arg=--no-continue-"
                             "streams (repeatable)")
    parser.add_argument("--show-failures", action="store_true",
                        help="print what the client saw for each failed request")
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    exit_on_sigterm()  # stopped with kill: still stop what it started
    if args.serve:
        serve_backend(args.serve, args.tokens, args.token_delay)
        return
    proxy_args = (["--decode-first-byte-timeout", str(args.first_byte_timeout)]
                  if args.first_byte_timeout else []) + args.proxy_arg
    print(f"2 prefill, 3 decode stand-ins; concurrency {args.concurrency}; one decode "
          f"killed or frozen {args.event_at:g} s into {args.seconds:g} s; proxy "
          f"{' '.join(proxy_args) or 'defaults'}")
    print(f"{'scenario':8} {'routing':18} {'requests':>8} {'failed':>7} "
          f"{'failed before streaming':>24} {'wrong':>6} {'longest first-token wait':>25} "
          f"{'seconds at half rate':>21}")
    log = open(args.proxy_log, "ab") if args.proxy_log else subprocess.DEVNULL
    for scenario in SCENARIOS:
        for routing in ROUTINGS:
            result = run(scenario, routing, args.seconds, args.event_at, args.concurrency,
                         args.tokens, args.token_delay, proxy_args, log)
            print(f"{scenario:8} {routing:18} {len(result.outcomes):8} {result.failed:7} "
                  f"{result.failed_before_streaming:24} {result.wrong:6} "
                  f"{result.longest_first_token_wait:24.2f}s {result.slow_seconds:21}",
                  flush=True)
            if args.show_failures:
                for outcome in result.outcomes:
                    if not outcome.ok:
                        print(f"    {'streamed' if outcome.streamed else 'nothing'}: "
                              f"{outcome.detail}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
