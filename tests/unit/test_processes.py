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
