"""etcd health, checked with an etcd v3 client and cached briefly per endpoint set."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aetcd


@dataclass(frozen=True)
class EtcdHealth:
    healthy: bool
    message: str


def split_endpoint(endpoint: str) -> tuple[str, int]:
    """`host:port`, `http://host:port` or `[::1]:port` into (host, port)."""
    address = endpoint.split("://", 1)[-1].rstrip("/")
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"etcd endpoint {endpoint!r} is not host:port")
    return host.strip("[]"), int(port)


async def probe_endpoint(endpoint: str, timeout: float) -> str | None:
    """None when the member answers Status and knows a leader; else why not."""
    try:
        host, port = split_endpoint(endpoint)
    except ValueError as err:
        return str(err)
    client = aetcd.Client(host=host, port=port, timeout=int(max(1, timeout)))
    try:
        status = await asyncio.wait_for(client.status(), timeout)
    except TimeoutError:
        return f"{endpoint}: no answer within {timeout:g}s"
    except Exception as err:  # grpc and aetcd raise several unrelated types
        return f"{endpoint}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    finally:
        await client.close()
    if status.leader is None:
        return f"{endpoint}: member has no leader"
    return None


class EtcdHealthChecker:
    """Healthy when any endpoint answers; results are reused for `ttl` seconds."""

    def __init__(self, timeout: float = 2.0, ttl: float = 10.0,
                 address_overrides: Mapping[str, str] | None = None) -> None:
        self.timeout = timeout
        self.ttl = ttl
        # Where to reach an endpoint when its name does not resolve from the operator's host
        # (an operator run outside the cluster, or the API emulator's demo): name -> host:port.
        self.address_overrides = dict(address_overrides or {})
        self._cache: dict[tuple[str, ...], tuple[float, EtcdHealth]] = {}

    async def check(self, endpoints: tuple[str, ...]) -> EtcdHealth:
        cached = self._cache.get(endpoints)
        now = time.monotonic()
        if cached and now - cached[0] < self.ttl:
            return cached[1]
        problems = await asyncio.gather(*(
            probe_endpoint(self.address_overrides.get(e, e), self.timeout) for e in endpoints))
        healthy = any(p is None for p in problems)
        answering = [e for e, p in zip(endpoints, problems, strict=True) if p is None]
        message = ("etcd answers at " + ", ".join(answering)
                   if healthy else "; ".join(p for p in problems if p))
        result = EtcdHealth(healthy=healthy, message=message)
        self._cache[endpoints] = (now, result)
        return result
