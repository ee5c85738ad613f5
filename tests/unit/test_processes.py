"""free_port hands out ports the kernel never picks on its own, so another process's outgoing
connection or bind to port 0 cannot take one between the call and the bind that uses it (a
replay lost its proxy that way: `address already in use` at start-up)."""

from __future__ import annotations

import socket
from pathlib import Path

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
