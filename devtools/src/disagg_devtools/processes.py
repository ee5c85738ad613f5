"""Small helpers for the real processes that dev tools, tests and benchmarks start."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
LOWEST_PORT = 20000  # clear of the well-known ports servers default to
NETNS_MARK = "DISAGG_BENCH_NETNS"  # set once a benchmark runs in its own network namespace
_handed_out: set[int] = set()


def free_port() -> int:
    """A loopback port nobody listens on right now, below the kernel's ephemeral range: the
    kernel never hands such a port to another process's outgoing connection or bind to port
    0, so none can take it between this call and the bind that uses it. Never the same port
    twice in one process."""
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768  # Linux's default
    low = LOWEST_PORT if ephemeral_low - LOWEST_PORT >= 1000 else 1024
    for _ in range(200):
        port = random.randrange(low, ephemeral_low)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free loopback port in {low}-{ephemeral_low - 1}")


def exit_on_sigterm() -> None:
    """Make SIGTERM end this process through its `finally` blocks and context managers (exit
    status 143), as Ctrl-C does: a benchmark stopped with `kill` or a timeout then stops the
    deployment it started instead of leaving every process of it running. Python's default
    ends the process on the spot."""
    def leave(signum: int, _frame: object) -> None:
        signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends it at once
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, leave)


def isolate_benchmark() -> None:
    """What a benchmark that starts servers does first: SIGTERM stops what it started
    (`exit_on_sigterm`), and, run as root, the whole process is run again inside a network
    namespace of its own with only loopback up, since Mooncake listens on every interface."""
    exit_on_sigterm()
    if os.getuid() == 0 and not os.environ.get(NETNS_MARK):
        os.environ[NETNS_MARK] = "1"
        os.execvp("unshare", ["unshare", "-n", "sh", "-c",
                              'ip link set lo up && exec "$0" "$@"', sys.executable, *sys.argv])


def stop_process(process: subprocess.Popen[Any] | None, grace: float = 10.0,
                 first: signal.Signals = signal.SIGTERM) -> None:
    """Signal `first`, wait up to `grace` seconds, then kill. A process already gone is fine."""
    if process is None or process.poll() is not None:
        return
    process.send_signal(first)
    try:
        process.wait(grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def log_tail(path: Path, lines: int = 25, indent: str = "") -> str:
    """The last `lines` lines of a log file, for an error message."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    return "\n".join(indent + line for line in text.splitlines()[-lines:])
