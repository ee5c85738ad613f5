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
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from kvhelper.instances import Instance, Role

log = logging.getLogger("kvhelper.proxy")
Routing = Literal["round-robin", "least-outstanding"]


@dataclass(eq=False)
class Backend:
    instance: Instance
    healthy: bool = True  # until a health check or failed requests say otherwise
    outstanding: int = 0
    failures: int = 0  # failed health checks in a row
    request_failures: int = 0  # failed requests in a row
    # Deadlines of the requests waiting on this instance: ejecting it expires them.
    waiting: set[asyncio.Timeout] = field(default_factory=set)

    @property
    def url(self) -> str:
        return self.instance.url

    @contextlib.asynccontextmanager
    async def deadline(self, seconds: float | None) -> AsyncIterator[asyncio.Timeout]:
        """A wait on this instance that times out after `seconds` (None: never), or at once
        when the instance is ejected."""
        async with asyncio.timeout(seconds) as deadline:
            self.waiting.add(deadline)
            try:
                yield deadline
            finally:
                self.waiting.discard(deadline)


@dataclass
class Pool:
    routing: Routing = "round-robin"
    eject_after: int = 2  # failed health checks, or failed requests, in a row
    backends: dict[str, Backend] = field(default_factory=dict)  # registration key -> backend
    _turn: dict[Role, itertools.count[int]] = field(default_factory=dict)

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

    def members(self, role: Role) -> list[Backend]:
        return [b for b in self.backends.values() if b.instance.role == role]

    def fingerprints(self, role: Role) -> set[str]:
        """The KV fingerprints of the healthy instances of a role."""
        return {b.instance.fingerprint for b in self.members(role) if b.healthy}

    def pick(self, role: Role, fingerprint: str | None = None,
             exclude: Iterable[Backend] = (), fingerprints: set[str] | None = None
             ) -> Backend | None:
        """A healthy instance of `role`, not in `exclude`, whose fingerprint is `fingerprint`
        (or one of `fingerprints`) when given. Least-outstanding breaks ties in turn, so
        that equal instances share the load."""
        excluded = set(map(id, exclude))
        candidates = [b for b in self.members(role) if b.healthy and id(b) not in excluded
                      and (fingerprint is None or b.instance.fingerprint == fingerprint)
                      and (fingerprints is None or b.instance.fingerprint in fingerprints)]
        if not candidates:
            return None
        if self.routing == "least-outstanding":
            low = min(b.outstanding for b in candidates)
            candidates = [b for b in candidates if b.outstanding == low]
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
        now = asyncio.get_running_loop().time()
        for deadline in list(backend.waiting):
            if not deadline.expired():  # one that expired has not left the set yet
                deadline.reschedule(now)

    async def check_health(self, session: aiohttp.ClientSession) -> None:
        async def probe(backend: Backend) -> None:
            try:
                async with session.get(f"{backend.url}/health") as response:
                    ok = response.status == 200
            except (aiohttp.ClientError, TimeoutError):
                ok = False
            if ok:
                if not backend.healthy:
                    log.info("readmitting %s", backend.url)
                backend.failures, backend.request_failures, backend.healthy = 0, 0, True
            else:
                backend.failures += 1
                if backend.failures >= self.eject_after:
                    self.eject(backend, f"{backend.failures} failed health checks")

        await asyncio.gather(*(probe(b) for b in list(self.backends.values())))
