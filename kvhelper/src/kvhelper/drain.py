"""Wait until a leaving vLLM instance has nothing left to do: its container's preStop hook.

When a pod is deleted (scale-down, rollout, node drain), the registrar beside vLLM gets SIGTERM
and withdraws the registration at once, so the proxy stops sending new work; this hook holds
vLLM's own SIGTERM back until no request has been running or waiting for `--quiet` seconds (a
request still routed here during that time restarts the count), or until `--timeout`, which
the operator sets below the pod's termination grace period. It always exits 0: a hook that
fails would only make the kubelet log it and kill the container anyway.

    python -m kvhelper.drain --url http://127.0.0.1:8000 --quiet 5 --timeout 290
"""

from __future__ import annotations

import argparse
import time
import urllib.request
from collections.abc import Callable

BUSY = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def requests_in_flight(metrics_text: str) -> float:
    """Running plus waiting requests, from vLLM's Prometheus text."""
    total = 0.0
    for line in metrics_text.splitlines():
        if line.startswith(BUSY):
            total += float(line.rsplit(" ", 1)[1])
    return total


def scrape(url: str) -> float | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as response:
            return requests_in_flight(response.read().decode())
    except OSError:
        return None  # the server is gone: nothing left to wait for


def drain(busy: Callable[[], float | None], quiet: float, timeout: float,
          interval: float = 0.5, clock: Callable[[], float] = time.monotonic,
          sleep: Callable[[float], None] = time.sleep) -> str:
    """Poll `busy` until it has read 0 (or None) for `quiet` seconds in a row, or `timeout`
    has passed; say which."""
    start = clock()
    idle_since: float | None = None
    while True:
        now = clock()
        count = busy()
        if count is None:
            return "the server is not answering"
        if count > 0:
            idle_since = None
        elif idle_since is None:
            idle_since = now
        if idle_since is not None and now - idle_since >= quiet:
            return f"idle for {quiet:g}s"
        if now - start >= timeout:
            return f"gave up after {timeout:g}s with {count:g} requests in flight"
        sleep(interval)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the vLLM server")
    parser.add_argument("--quiet", type=float, default=5.0,
                        help="seconds without a running or waiting request")
    parser.add_argument("--timeout", type=float, default=290.0)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    print(f"drain {args.url}: " + drain(lambda: scrape(args.url), args.quiet, args.timeout),
          flush=True)


if __name__ == "__main__":
    main()
