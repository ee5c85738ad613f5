"""The instances the proxy can use, their health, and how one is picked for a phase.

Health is active and passive. Active: every instance's /health is polled, and `eject_after`
failed polls in a row eject it until a poll succeeds again. Passive: a request that cannot reach
an instance ejects it at once, and `eject_after` failed requests in a row (5xx, a stream that
never started) eject it too, before the next poll; requests still waiting for that instance's
first byte are then given up (their wait times out now) so the proxy can retry them elsewhere,
and streams under way on it end with an error event instead of waiting out the silence limit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from kvhelper.instances import Instance, Role
from kvhelper.proxy.held_prefixes import HeldPrefixes

log = logging.getLogger("kvhelper.proxy")
Routing = Literal["round-robin", "least-outstanding"]


@dataclass(eq=False)
class Backend:
    instance: Instance
    healthy: bool = True  # until a health check or failed requests say otherwise
    outstanding: int = 0
    queued_tokens: int = 0  # prompt tokens not in the store, of the prefills in progress here
    held: HeldPrefixes = field(default_factory=HeldPrefixes)  # a prefill's own prefix cache
    failures: int = 0  # failed health checks in a row
    request_failures: int = 0  # failed requests in a row
    # Deadlines of the requests waiting on this instance: ejecting it expires them.
    waiting: set[asyncio.Timeout] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.instance.url

    def deadline(self, seconds: float | None) -> Deadline:
        """A wait on this instance that times out after `seconds` (None: never), or at once
        when the instance is ejected."""
        return Deadline(self, seconds)


class Deadline:
    """`async with backend.deadline(s)`: asyncio.timeout, registered with the backend while
    it runs (a class, not a generator: it is on every decode's path)."""

    __slots__ = ("_backend", "_timeout")

    def __init__(self, backend: Backend, seconds: float | None) -> None:
        self._backend, self._timeout = backend, asyncio.timeout(seconds)

    async def __aenter__(self) -> asyncio.Timeout:
        timeout = await self._timeout.__aenter__()
        self._backend.waiting.add(timeout)
        return timeout

    async def __aexit__(self, *exc: Any) -> None:
        self._backend.waiting.discard(self._timeout)
        await self._timeout.__aexit__(*exc)  # raises TimeoutError when it expired


@dataclass
class Pool:
    routing: Routing = "round-robin"
    eject_after: int = 2  # failed health checks, or failed requests, in a row
    backends: dict[str, Backend] = field(default_factory=dict)  # registration key -> backend
    _turn: dict[Role, itertools.count[int]] = field(default_factory=dict)
    # Per role, the healthy instances' fingerprints: asked on every request, changed only by
    # membership and health.
    _fingerprints: dict[Role, set[str]] = field(default_factory=dict)

    def update(self, instances: dict[str, Instance]) -> None:
        """Replace the membership, keeping the state of instances that stay."""
        kept = {}
        for key, instance in instances.items():
            current = self.backends.get(key)
            kept[key] = current if current and current.instance == instance else Backend(instance)
        for key in set(self.backends) - set(kept):
            log.info("instance left: %s", self.backends[key].url)
        for key in set(kept) - set(self.backends):
            log.info("instance joined: %s %s", kept[key].instance.role, kept[key].url)
        self.backends = kept
        self._fingerprints.clear()

    def members(self, role: Role) -> list[Backend]:
        return [b for b in self.backends.values() if b.instance.role == role]

    def fingerprints(self, role: Role) -> set[str]:
        """The KV fingerprints of the healthy instances of a role."""
        found = self._fingerprints.get(role)
        if found is None:
            found = self._fingerprints[role] = {b.instance.fingerprint
                                                for b in self.members(role) if b.healthy}
        return found

    def pick(self, role: Role, fingerprint: str | None = None,
             exclude: Iterable[Backend] = (), fingerprints: set[str] | None = None,
             load: Callable[[Backend], Any] | None = None) -> Backend | None:
        """A healthy instance of `role`, not in `exclude`, whose fingerprint is `fingerprint`
        (or one of `fingerprints`) when given: the least `load` (by default the routing
        policy's: none for round-robin, outstanding requests for least-outstanding), ties
        taken in turn so that equal instances share the load."""
        excluded = set(map(id, exclude))
        candidates = [b for b in self.members(role) if b.healthy and id(b) not in excluded
                      and (fingerprint is None or b.instance.fingerprint == fingerprint)
                      and (fingerprints is None or b.instance.fingerprint in fingerprints)]
        if not candidates:
            return None
        if load is None and self.routing == "least-outstanding":
            load = _outstanding
        if load is not None:
            loads = [load(b) for b in candidates]
            low = min(loads)
            candidates = [b for b, value in zip(candidates, loads, strict=True) if value == low]
        turn = next(self._turn.setdefault(role, itertools.count()))
        return candidates[turn % len(candidates)]

    def request_succeeded(self, backend: Backend) -> None:
        backend.request_failures = 0

    def request_failed(self, backend: Backend, why: str, eject_now: bool = False) -> None:
        """Count a failed request against the instance; eject it when it is unreachable or
        has failed `eject_after` requests in a row."""
        backend.request_failures += 1
        if eject_now or backend.request_failures >= self.eject_after:
            self.eject(backend, f"{why} ({backend.request_failures} failed requests in a row)")

    def eject(self, backend: Backend, why: str) -> None:
        if backend.healthy:
            log.warning("ejecting %s: %s", backend.url, why)
            backend.healthy = False
            self._fingerprints.clear()
        now = asyncio.get_running_loop().time()
        for deadline in list(backend.waiting):
            if not deadline.expired():  # one that expired has not left the set yet
                deadline.reschedule(now)

    async def check_health(self, session: aiohttp.ClientSession) -> None:
        async def probe(backend: Backend) -> None:
            late = False
            try:
                async with session.get(f"{backend.url}/health") as response:
                    ok = response.status == 200
            except TimeoutError:
                ok, late = False, True
            except aiohttp.ClientError:
                ok = False
            if ok:
                if not backend.healthy:
                    log.info("readmitting %s", backend.url)
                    self._fingerprints.clear()
                backend.failures, backend.request_failures, backend.healthy = 0, 0, True
                return
            backend.failures += 1
            if backend.failures < self.eject_after:
                return
            if late and self._last_healthy(backend):
                # Too busy to answer in time, and nothing else of its role to send work to:
                # ejecting it would only give up every request it is serving.
                if backend.failures == self.eject_after:
                    log.warning("keeping %s: its health checks time out, but it is the only "
                                "healthy %s instance", backend.url, backend.instance.role)
                return
            self.eject(backend, f"{backend.failures} failed health checks")

        await asyncio.gather(*(probe(b) for b in list(self.backends.values())))

    def _last_healthy(self, backend: Backend) -> bool:
        return backend.healthy and not any(
            b.healthy for b in self.members(backend.instance.role) if b is not backend)


def _outstanding(backend: Backend) -> int:
    return backend.outstanding
