"""etcd health, cached briefly per endpoint set: an etcd v3 client's Status call, or, for an
etcd serving TLS (spec.etcd.tls), etcd's own `/health`: over plain HTTP on a managed etcd's
metrics port, or over HTTPS with the operator's own client certificate for an external one.
The operator never reads the DisaggServing's Secrets."""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aetcd
import aiohttp

from disagg_operator.plan import ETCD_METRICS_PORT

# The chart mounts the operator's own etcd client certificate here (etcdClientTLS.secretName).
OPERATOR_TLS_HINT = ("give the operator a client certificate that etcd accepts (the chart's "
                     "etcdClientTLS.secretName, or --etcd-tls-dir)")


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


async def probe_health_url(url: str, timeout: float,
                           context: ssl.SSLContext | None = None) -> str | None:
    """None when etcd's `/health` at `url` says healthy (it needs a leader); else why not."""
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
                s.get(url, ssl=context if context is not None else True) as response:
            body = await response.json(content_type=None)
    except TimeoutError:
        return f"{url}: no answer within {timeout:g}s"
    except (aiohttp.ClientError, ValueError, ssl.SSLError) as err:
        return f"{url}: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if not isinstance(body, dict) or body.get("health") != "true":
        return f"{url}: {body}"
    return None


def client_tls_context(folder: Path) -> ssl.SSLContext:
    """TLS to etcd from PEM files in cert-manager's layout (ca.crt, tls.crt, tls.key)."""
    context = ssl.create_default_context(cafile=str(folder / "ca.crt"))
    context.load_cert_chain(str(folder / "tls.crt"), str(folder / "tls.key"))
    return context


class EtcdHealthChecker:
    """Healthy when any endpoint answers; results are reused for `ttl` seconds."""

    def __init__(self, timeout: float = 2.0, ttl: float = 10.0,
                 address_overrides: Mapping[str, str] | None = None,
                 tls_dir: Path | None = None) -> None:
        self.timeout = timeout
        self.ttl = ttl
        # Where to reach an endpoint when its name does not resolve from the operator's host
        # (an operator run outside the cluster, or the API emulator's demo): name -> host:port.
        self.address_overrides = dict(address_overrides or {})
        # The operator's own client certificate, for external etcds that require one.
        self.tls_dir = tls_dir
        self._cache: dict[tuple[str | None, tuple[str, ...]], tuple[float, EtcdHealth]] = {}

    async def check(self, endpoints: tuple[str, ...], via: str | None = None) -> EtcdHealth:
        """`via` as the plan's etcd_health_via: None (gRPC Status), "metrics" or "https"."""
        cached = self._cache.get((via, endpoints))
        now = time.monotonic()
        if cached and now - cached[0] < self.ttl:
            return cached[1]
        problems = await asyncio.gather(*(self._probe(e, via) for e in endpoints))
        healthy = any(p is None for p in problems)
        answering = [e for e, p in zip(endpoints, problems, strict=True) if p is None]
        message = ("etcd answers at " + ", ".join(answering)
                   if healthy else "; ".join(p for p in problems if p))
        result = EtcdHealth(healthy=healthy, message=message)
        self._cache[(via, endpoints)] = (now, result)
        return result

    async def _probe(self, endpoint: str, via: str | None) -> str | None:
        if via is None:
            return await probe_endpoint(self.address_overrides.get(endpoint, endpoint),
                                        self.timeout)
        host, _ = split_endpoint(endpoint)
        if via == "metrics":
            target = self.address_overrides.get(f"{host}:{ETCD_METRICS_PORT}",
                                                f"{host}:{ETCD_METRICS_PORT}")
            return await probe_health_url(f"http://{target}/health", self.timeout)
        if self.tls_dir is None:
            return f"{endpoint}: etcd requires TLS; {OPERATOR_TLS_HINT}"
        try:
            context = client_tls_context(self.tls_dir)
        except (OSError, ssl.SSLError) as err:
            return f"{endpoint}: the operator's etcd client certificate in {self.tls_dir}: {err}"
        target = self.address_overrides.get(endpoint, endpoint)
        return await probe_health_url(f"https://{target}/health", self.timeout, context)
