"""The instances the proxy can use, their health, and how one is picked for a phase."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

import aiohttp

from kvhelper.instances import Instance, Role

log = logging.getLogger("kvhelper.proxy")
Routing = Literal["round-robin", "least-outstanding"]


@dataclass(eq=False)
class Backend:
    instance: Instance
    healthy: bool = True  # until a health check says otherwise
    outstanding: int = 0
    failures: int = 0

    @property
    def url(self) -> str:
        return self.instance.url


@dataclass
class Pool:
    routing: Routing = "round-robin"
    eject_after: int = 2  # consecutive failed health checks
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

    def pick(self, role: Role, fingerprint: str | None = None,
             exclude: Iterable[Backend] = ()) -> Backend | None:
        excluded = set(map(id, exclude))
        candidates = [b for b in self.members(role) if b.healthy and id(b) not in excluded
                      and (fingerprint is None or b.instance.fingerprint == fingerprint)]
        if not candidates:
            return None
        if self.routing == "least-outstanding":
            return min(candidates, key=lambda b: b.outstanding)
        turn = next(self._turn.setdefault(role, itertools.count()))
        return candidates[turn % len(candidates)]

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
                backend.failures, backend.healthy = 0, True
            else:
                backend.failures += 1
                if backend.healthy and backend.failures >= self.eject_after:
                    log.warning("ejecting %s after %d failed health checks", backend.url,
                                backend.failures)
                    backend.healthy = False

        await asyncio.gather(*(probe(b) for b in list(self.backends.values())))
