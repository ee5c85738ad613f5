"""Benchmark: the latency the proxy adds and the request rate one proxy process sustains.

Instant backends (a minimal vLLM-like server in its own process) answer prefill and decode.
Measured in one run: p50/p99 latency calling the decode backend directly vs through the proxy
(which also makes the prefill call), one request at a time over N requests each, in two
placements: the proxy on a core of its own, and all processes on one core (on a VM, waking an
idle core costs far more than the proxy's own work; the second placement shows that work). As
root, the first placement is measured again with idle cores polling instead of halting
(`/dev/cpu_dma_latency` held at 0 for that measurement only, as tuned's latency-performance
profile does), which removes the wake-up cost and leaves the cross-core hops. Then
the proxy's throughput at a fixed concurrency for a fixed number of requests, with the proxy
pinned to one core (taskset) and the backend and load generator on the other. Bounded by
--requests.

    .venv-serving/bin/python benchmarks/proxy_overhead.py --requests 2000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import struct
import subprocess
import sys
import time
from collections.abc import Iterator

import aiohttp
import msgspec
from aiohttp import web
from disagg_devtools.processes import exit_on_sigterm, free_port, stop_process

PREFILL_ANSWER = {"choices": [{"index": 0, "text": "x"}],
                  "kv_transfer_params": {"do_remote_prefill": True, "remote_engine_id": "b",
                                         "remote_block_ids": [1], "remote_host": "h",
                                         "remote_port": 1}}
DECODE_ANSWER = {"choices": [{"index": 0, "text": "hello world"}]}
# Answers encoded once: an instant backend should spend as little as it can per request, so
# that the extra backend call the proxy makes costs what a network hop costs, not JSON work.
PREFILL_BYTES = msgspec.json.encode(PREFILL_ANSWER)
DECODE_BYTES = msgspec.json.encode(DECODE_ANSWER)


def serve_backend(port: int) -> None:
    decode_json = msgspec.json.Decoder().decode

    async def complete(request: web.Request) -> web.Response:
        body = decode_json(await request.read())
        remote = (body.get("kv_transfer_params") or {}).get("do_remote_decode")
        return web.Response(body=PREFILL_BYTES if remote else DECODE_BYTES,
                            content_type="application/json")

    async def health(request: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/health", health)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None,
                loop=fast_loop())


def fast_loop() -> asyncio.AbstractEventLoop:
    """uvloop where installed (vLLM's image has it), for the backend and the load generator
    too: on a 2-core machine they share the core the proxy is not pinned to."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU time a process has used so far (Linux /proc)."""
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    return sum(cpu_times(pid))


async def wait_up(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url) as response:
                    if response.status in (200, 503):
                        return
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not come up")
            await asyncio.sleep(0.1)


async def latencies(url: str, count: int, body: dict[str, object]) -> list[float]:
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            started = time.perf_counter()
            async with session.post(url, json=body) as response:
                await response.read()
                assert response.status == 200, response.status
            times.append(time.perf_counter() - started)
    return sorted(times)


async def throughput(url: str, count: int, concurrency: int) -> float:
    remaining = count
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                async with session.post(url, json={"prompt": "x", "max_tokens": 4}) as r:
                    await r.read()
                    assert r.status == 200, r.status

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return count / (time.perf_counter() - started)


def pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] * 1000


def two_cores() -> bool:
    return bool(shutil.which("taskset")) and len(os.sched_getaffinity(0)) > 1


def pinned(cpu: int, command: list[str]) -> list[str]:
    return ["taskset", "-c", str(cpu), *command] if two_cores() else command


@contextlib.contextmanager
def polling_idle() -> Iterator[bool]:
    """Hold a CPU wake-up latency limit of 0 (idle cores poll) while open; the kernel drops the
    limit when the file is closed. Yields False where that cannot be set (not root)."""
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
    except OSError:
        yield False
        return
    try:
        os.write(fd, struct.pack("i", 0))
        yield True
    finally:
        os.close(fd)


def place(cpus: dict[int, set[int]]) -> None:
    """Move processes (pid -> allowed cores); pid 0 is this load generator."""
    for pid, allowed in cpus.items():
        os.sched_setaffinity(pid, allowed)


async def added_latency(label: str, direct_url: str, proxy_url: str, proxy_pid: int,
                        requests: int) -> None:
    body = {"prompt": "x", "max_tokens": 4}
    direct_body = {**body, "kv_transfer_params": PREFILL_ANSWER["kv_transfer_params"]}
    await latencies(direct_url, 200, direct_body)  # warm up both paths
    await latencies(proxy_url, 200, body)
    direct = await latencies(direct_url, requests, direct_body)
    cpu_before = cpu_seconds(proxy_pid)
    through = await latencies(proxy_url, requests, body)
    proxy_cpu = (cpu_seconds(proxy_pid) - cpu_before) / requests
    print(f"{label}:")
    print(f"  decode backend directly:  p50 {pct(direct, 0.5):.3f} ms  "
          f"p99 {pct(direct, 0.99):.3f} ms")
    print(f"  through the proxy:        p50 {pct(through, 0.5):.3f} ms  "
          f"p99 {pct(through, 0.99):.3f} ms  (prefill + decode calls)")
    print(f"  added by the proxy:       p50 {pct(through, 0.5) - pct(direct, 0.5):.3f} ms  "
          f"p99 {pct(through, 0.99) - pct(direct, 0.99):.3f} ms  (target p50 < 1 ms)")
    print(f"  proxy CPU per request:    {proxy_cpu * 1000:.3f} ms (user + system)")


async def main(requests: int, concurrency: int) -> None:
    backend_port, proxy_port = free_port(), free_port()
    backend = subprocess.Popen(pinned(1, [sys.executable, __file__, "--serve-backend",
                                          str(backend_port)]))
    backend_addr = f"127.0.0.1:{backend_port}"
    proxy = subprocess.Popen(pinned(0, [
        sys.executable, "-m", "kvhelper.proxy", "--host", "127.0.0.1", "--port", str(proxy_port),
        "--prefill", backend_addr, "--decode", backend_addr]), stderr=subprocess.DEVNULL)
    try:
        await wait_up(f"http://{backend_addr}/health")
        await wait_up(f"http://127.0.0.1:{proxy_port}/health")
        direct_url = f"http://{backend_addr}/v1/completions"
        proxy_url = f"http://127.0.0.1:{proxy_port}/v1/completions"
        print(f"requests per latency measurement: {requests} (one at a time)")
        if two_cores():
            # Every hop crosses cores: on a VM an idle core's wake-up is paid in system time.
            place({0: {1}})
            await added_latency("proxy on core 0, backend and client on core 1", direct_url,
                                proxy_url, proxy.pid, requests)
            with polling_idle() as polling:
                if polling:
                    await added_latency("the same, idle cores polling (cpu_dma_latency 0)",
                                        direct_url, proxy_url, proxy.pid, requests)
            # No cross-core wake-ups: all the proxy's own time is on the critical path.
            place({proxy.pid: {1}})
            await added_latency("all on one core", direct_url, proxy_url, proxy.pid, requests)
            place({proxy.pid: {0}, 0: set(os.sched_getaffinity(backend.pid)) | {0, 1}})
        else:
            await added_latency("unpinned", direct_url, proxy_url, proxy.pid, requests)
        user_before, system_before = cpu_times(proxy.pid)
        rate = await throughput(proxy_url, requests * 2, concurrency)
        user_after, system_after = cpu_times(proxy.pid)
        system = system_after - system_before
        proxy_cpu = user_after - user_before + system
        per_request = proxy_cpu / (requests * 2)
        busy = proxy_cpu * rate / (requests * 2)  # fraction of its core the proxy used
        print(f"proxy throughput:           {rate:.0f} requests/s at concurrency {concurrency}, "
              f"{requests * 2} requests, proxy pinned to one core")
        print(f"proxy CPU per request:      {per_request * 1e6:.0f} us; its core was "
              f"{busy:.0%} busy, so one full core sustains {1 / per_request:.0f} requests/s "
              f"(target >= 2000/s); {system / proxy_cpu:.0%} of it in the kernel")
    finally:
        for proc in (proxy, backend):
            stop_process(proc)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--serve-backend", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    exit_on_sigterm()  # stopped with kill: still stop what it started
    if args.serve_backend:
        serve_backend(args.serve_backend)
    else:
        fast_loop().run_until_complete(main(args.requests, args.concurrency))
