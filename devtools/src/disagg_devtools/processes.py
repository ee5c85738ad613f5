"""Small helpers for the real processes that dev tools, tests and benchmarks start."""

from __future__ import annotations

import signal
import socket
import subprocess
from pathlib import Path
from typing import Any


def free_port() -> int:
    """A loopback port nobody listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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
