"""Where the proxy learns its instances: a static list, or the etcd prefix the registrars write.

The etcd source reads the prefix, then watches it from the next revision; when the watch breaks
(etcd restarted, network) it reconnects with backoff and reads the prefix again, so the view
converges on what etcd holds.

A registration leaves the view at once when it was withdrawn (its registrar marks it
`withdrawing` before deleting it: a drain, SIGTERM, an unhealthy instance). One that disappears
unmarked had its lease expire: its registrar crashed, or could not renew while etcd stalled,
which on a busy node takes seconds. That instance may well be serving, so it stays in the view
for `lapse_grace` seconds, during which the proxy's own health checks judge it, until it
registers again or the grace ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

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


class RegistrationView:
    """What etcd holds, plus the registrations that expired unwithdrawn, for a grace."""

    def __init__(self, lapse_grace: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.lapse_grace, self.clock = lapse_grace, clock
        self.live: dict[str, Instance] = {}
        self.lapsed: dict[str, tuple[Instance, float]] = {}  # key -> (instance, until)

    def instances(self) -> dict[str, Instance]:
        return {**{key: instance for key, (instance, _) in self.lapsed.items()}, **self.live}

    def snapshot(self, found: dict[str, Instance]) -> None:
        """A fresh read of the prefix: what vanished since the last view lapsed."""
        for key in set(self.live) - set(found):
            self._lapse(key)
        self.live = {k: v for k, v in found.items() if not v.withdrawing}
        for key in found:  # registered again, or being withdrawn: not lapsed any more
            self.lapsed.pop(key, None)

    def put(self, key: str, instance: Instance) -> None:
        self.lapsed.pop(key, None)
        if instance.withdrawing:
            if self.live.pop(key, None) is not None:
                log.info("withdrawn: %s", instance.url)
        else:
            self.live[key] = instance

    def delete(self, key: str) -> None:
        if key in self.live:
            self._lapse(key)

    def expire(self) -> bool:
        """Drop lapsed registrations past their grace; True when any was dropped."""
        now = self.clock()
        over = [key for key, (_, until) in self.lapsed.items() if until <= now]
        for key in over:
            log.info("lapsed registration %s not renewed in %.0f s: dropped", key,
                     self.lapse_grace)
            del self.lapsed[key]
        return bool(over)

    def next_expiry_in(self) -> float | None:
        if not self.lapsed:
            return None
        return max(0.0, min(until for _, until in self.lapsed.values()) - self.clock())

    def _lapse(self, key: str) -> None:
        instance = self.live.pop(key)
        if self.lapse_grace > 0:
            log.warning("the registration of %s %s expired without a withdrawal: kept for "
                        "%.0f s while it answers health checks", instance.role, instance.url,
                        self.lapse_grace)
            self.lapsed[key] = (instance, self.clock() + self.lapse_grace)


class EtcdDiscovery:
    def __init__(self, endpoints: list[tuple[str, int]], prefix: str,
                 backoff: tuple[float, ...] = (0.2, 0.5, 1.0, 2.0, 5.0),
                 tls: EtcdTls | None = None, lapse_grace: float = 30.0) -> None:
        self.endpoints = endpoints
        self.prefix = prefix
        self.tls = tls
        self.backoff = backoff
        self.connected = asyncio.Event()
        self.view = RegistrationView(lapse_grace)

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
        view = self.view
        async with etcd_client(host, port, tls=self.tls) as client:
            snapshot = await client.get_prefix(prefix)
            found: dict[str, Instance] = {}
            for kv in snapshot:
                if (instance := _parse(kv.key, kv.value)) is not None:
                    found[kv.key.decode()] = instance
            view.snapshot(found)
            listener(view.instances())
            self.connected.set()
            watch = await client.watch_prefix(
                prefix, start_revision=snapshot.header.revision + 1)
            stopper = asyncio.create_task(stop.wait())
            next_event: asyncio.Future[Any] | None = None
            try:
                iterator = watch.__aiter__()
                while True:
                    if next_event is None:
                        next_event = asyncio.ensure_future(iterator.__anext__())
                    done, _ = await asyncio.wait({next_event, stopper},
                                                 timeout=view.next_expiry_in(),
                                                 return_when=asyncio.FIRST_COMPLETED)
                    if stopper in done:
                        return
                    if next_event not in done:  # a lapsed registration's grace ended
                        if view.expire():
                            listener(view.instances())
                        continue
                    event, next_event = next_event.result(), None
                    key = event.kv.key.decode()
                    if event.kind == "DELETE":
                        view.delete(key)
                    elif (instance := _parse(event.kv.key, event.kv.value)) is not None:
                        view.put(key, instance)
                    view.expire()
                    listener(view.instances())
            except StopAsyncIteration:
                raise ConnectionError("the etcd watch ended") from None
            finally:
                if next_event is not None:
                    next_event.cancel()
                stopper.cancel()
                with contextlib.suppress(Exception):
                    await watch.cancel()


def _parse(key: bytes, value: bytes) -> Instance | None:
    try:
        return Instance.from_json(value)
    except (ValueError, KeyError) as err:
        log.warning("ignoring malformed registration %s: %s", key.decode(), err)
        return None


def _as_url(value: str) -> str:
    value = value.strip().rstrip("/")
    return value if "://" in value else f"http://{value}"
