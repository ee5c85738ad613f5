"""How dev tools set up the processes they start: free_port hands out ports the kernel never
picks on its own, so another process's outgoing connection or bind to port 0 cannot take one
between the call and the bind that uses it (a replay lost its proxy that way: `address already
in use` at start-up); share_cores gives engines sharing a small machine unbound threads."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
from disagg_devtools.processes import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def test_free_ports_are_below_the_kernels_ephemeral_range_and_bindable() -> None:
    low = int(RANGE.read_text().split()[0]) if RANGE.exists() else 32768
    ports = [free_port() for _ in range(50)]
    assert all(1024 <= port < low for port in ports), ports
    assert len(set(ports)) == len(ports)  # none handed out twice
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_engines_sharing_cores_get_unbound_threads_unless_asked_for_vllms_binding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from disagg_devtools.local.runner import share_cores

    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share_cores(0)
    assert "VLLM_CPU_OMP_THREADS_BIND" not in os.environ and "OMP_NUM_THREADS" not in os.environ
    share_cores(1)
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert os.environ["OMP_NUM_THREADS"] == "1"


def test_a_benchmark_stopped_with_sigterm_still_stops_what_it_started() -> None:
    """A replay killed with SIGTERM (`kill`, a timeout) left its whole local deployment running:
    Python's default SIGTERM ends the process without running `finally`, where the benchmark
    stops the deployment. With exit_on_sigterm, SIGTERM ends it through `finally`."""
    import signal
    import subprocess
    import sys

    script = ("import time\n"
              "from disagg_devtools.processes import exit_on_sigterm\n"
              "exit_on_sigterm()\n"
              "try:\n"
              "    print('ready', flush=True)\n"
              "    time.sleep(30)\n"
              "finally:\n"
              "    print('stopped what it started', flush=True)\n")
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline() == "ready\n"
    child.send_signal(signal.SIGTERM)
    out, _ = child.communicate(timeout=10)
    assert out == "stopped what it started\n"
    assert child.returncode == 128 + signal.SIGTERM
