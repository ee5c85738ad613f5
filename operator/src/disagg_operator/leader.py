"""Leader election over a coordination.k8s.io Lease, as client-go's leaderelection does it, so
that of several operator replicas exactly one reconciles and a standby takes over when it dies.

Why a Lease rather than kopf's peering: kopf's peering pauses lower-priority operators, but
replicas of one Deployment share a priority, and equal peers all keep running; a Lease is the
Kubernetes convention (kube-controller-manager, controller-runtime) and needs only RBAC on one
Lease in the operator's namespace.

The protocol: a candidate takes the Lease when it does not exist, when it holds it already, or
when its holder has not renewed it for `lease_seconds` as seen by this candidate's own clock
(never by comparing timestamps written by another machine). Every write names the
resourceVersion it read, so of two candidates racing only one succeeds. The leader renews every
`retry_seconds`; if no renewal succeeds for `renew_deadline_seconds` (shorter than the lease,
so it stops before anyone else can start) it has lost and must stop reconciling.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseRecord:
    holder: str  # "" when released
    lease_seconds: int
    acquired: str  # RFC 3339 with microseconds (the Lease's MicroTime)
    renewed: str
    transitions: int = 0
    version: str | None = None  # the resourceVersion read; None for a new Lease


class LeaseStore(Protocol):
    async def get(self) -> LeaseRecord | None: ...
    async def create(self, record: LeaseRecord) -> bool: ...  # False: someone was first
    async def update(self, record: LeaseRecord) -> bool: ...  # False: it changed meanwhile


@dataclass(frozen=True)
class ElectionSettings:
    identity: str
    lease_seconds: float = 15.0
    renew_deadline_seconds: float = 10.0
    retry_seconds: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.retry_seconds < self.renew_deadline_seconds < self.lease_seconds:
            raise ValueError("leader election needs retry < renew deadline < lease duration")


def micro_time(moment: datetime | None = None) -> str:
    return (moment or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, store: LeaseStore, settings: ElectionSettings,
                 clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], str] = micro_time) -> None:
        self.store = store
        self.settings = settings
        self.clock = clock
        self.wall_clock = wall_clock
        self.leading = asyncio.Event()
        self._observed: LeaseRecord | None = None
        self._observed_at = 0.0

    async def run(self) -> None:
        """Acquire, then renew until a renewal deadline passes; returns when leadership is
        lost (cancel it to stop sooner)."""
        while not await self._attempt():
            await asyncio.sleep(self.settings.retry_seconds)
        self.leading.set()
        log.info("%s leads", self.settings.identity)
        renewed = self.clock()
        while True:
            await asyncio.sleep(self.settings.retry_seconds)
            if await self._attempt():
                renewed = self.clock()
            elif self.clock() - renewed > self.settings.renew_deadline_seconds:
                self.leading.clear()
                log.error("%s lost the lease: no renewal for %.1f s", self.settings.identity,
                          self.clock() - renewed)
                return

    async def release(self) -> None:
        """Hand the Lease back at shutdown, so that a standby need not wait for it to expire."""
        if not self.leading.is_set():
            return
        self.leading.clear()
        try:
            current = await self.store.get()
            if current is not None and current.holder == self.settings.identity:
                await self.store.update(replace(current, holder="", lease_seconds=1,
                                                renewed=self.wall_clock()))
        except Exception as err:  # it expires on its own
            log.warning("could not release the lease: %s", err)

    async def _attempt(self) -> bool:
        try:
            return await self._acquire_or_renew()
        except Exception as err:  # the API server out of reach: a failed attempt
            log.warning("lease attempt failed: %s", err)
            return False

    async def _acquire_or_renew(self) -> bool:
        me, now = self.settings.identity, self.wall_clock()
        current = await self.store.get()
        if current is None:
            record = LeaseRecord(me, self._whole_seconds(), now, now)
            if not await self.store.create(record):
                return False
            self._observe(record)
            return True
        if self._observed is None or _content(current) != _content(self._observed):
            self._observe(current)
        else:
            self._observed = current  # same holder and renewal; keep when it was first seen
        held_by_other = current.holder not in ("", me)
        # The longer of the holder's declared lease and ours (the API keeps whole seconds).
        lasts = max(current.lease_seconds, self.settings.lease_seconds)
        if held_by_other and self.clock() < self._observed_at + lasts:
            return False
        record = replace(current, holder=me, lease_seconds=self._whole_seconds(),
                         renewed=now,
                         acquired=current.acquired if current.holder == me else now,
                         transitions=current.transitions + (current.holder != me))
        if not await self.store.update(record):
            return False
        self._observe(replace(record, version=None))
        return True

    def _whole_seconds(self) -> int:
        return max(1, math.ceil(self.settings.lease_seconds))

    def _observe(self, record: LeaseRecord) -> None:
        self._observed, self._observed_at = record, self.clock()


def _content(record: LeaseRecord) -> tuple[str, str, int]:
    return record.holder, record.renewed, record.lease_seconds
