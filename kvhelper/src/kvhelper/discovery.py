"""Where the proxy learns its instances: a static list, or the etcd prefix the registrars write.

The etcd source reads the prefix, then watches it from the next revision; when the watch breaks
(etcd restarted, network) it reconnects with backoff and reads the prefix again, so the view
converges on what etcd holds. Expired registrations disappear with their lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvhelper.etcd_client import EtcdTls, etcd_client
from kvhelper.instances import Instance

log = logging.getLogger("kvhelper.discovery")
Listener = Callable[[dict[str, Instance]], None]


class StaticDiscovery:
    def __init__(self, prefill: list[str], decode: list[str], model: str = "") -> None:
        self.instances = {
            f"static/{role}/{i}": Instance(id=f"{role}-{i}", role=role,  # type: ignore[arg-type]
                                           url=_as_url(url), model=model)
            for role, urls in (("prefill", prefill), ("decode", decode))
            for i, url in enumerate(urls)}

    async def run(self, listener: Listener, stop: asyncio.Event) -> None:
        listener(dict(self.instances))
        await stop.wait()


class EtcdDiscovery:
    def __init__(self, endpoints: list[tuple[str, int]], prefix: str,
                 backoff: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 5.0),
                 tls: EtcdTls | None = None) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.tls = tls
        self.backoff = backoff
        self.connected = asyncio.Event()

    async def run(self, listener: Listener, stop: asyncio.Event) -> None:
        attempt = 0
        while not stop.is_set():
            host, port = self.endpoints[attempt % len(self.endpoints)]
            try:
                await self._follow(host, port, listener, stop)
                attempt = 0
            except Exception as err:  # grpc/aetcd raise many types; all mean "reconnect"
                self.connected.clear()
                delay = self.backoff[min(attempt, len(self.backoff) - 1)]
                log.warning("etcd %s:%s: %s; retrying in %.1fs", host, port, err, delay)
                attempt += 1
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)

    async def _follow(self, host: str, port: int, listener: Listener,
                      stop: asyncio.Event) -> None:
        prefix = self.prefix.encode()
        async with etcd_client(host, port, tls=self.tls) as client:
            snapshot = await client.get_prefix(prefix)
            instances: dict[str, Instance] = {}
            for kv in snapshot:
                _apply(instances, kv.key, kv.value)
            listener(dict(instances))
            self.connected.set()
            watch = await client.watch_prefix(
                prefix, start_revision=snapshot.header.revision + 1)
            stopper = asyncio.create_task(stop.wait())
            try:
                iterator = watch.__aiter__()
                while True:
                    next_event = asyncio.ensure_future(iterator.__anext__())
                    done, _ = await asyncio.wait({next_event, stopper},
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if stopper in done:
                        next_event.cancel()
                        return
                    event = next_event.result()
                    if event.kind == "DELETE":
                        instances.pop(event.kv.key.decode(), None)
                    else:
                        _apply(instances, event.kv.key, event.kv.value)
                    listener(dict(instances))
            except StopAsyncIteration:
                raise ConnectionError("the etcd watch ended") from None
            finally:
                stopper.cancel()
                with contextlib.suppress(Exception):
                    await watch.cancel()


def _apply(instances: dict[str, Instance], key: bytes, value: bytes) -> None:
    try:
        instances[key.decode()] = Instance.from_json(value)
    except (ValueError, KeyError) as err:
        log.warning("ignoring malformed registration %s: %s", key.decode(), err)


def _as_url(value: str) -> str:
    value = value.strip().rstrip("/")
    return value if "://" in value else f"http://{value}"
