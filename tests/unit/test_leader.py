"""Leader election over a Lease: one leader, takeover after expiry, loss after the renewal
deadline, release at shutdown. The store is an in-memory Lease with the API server's
resourceVersion preconditions (test double); the real Lease is exercised against the emulator
by tests/integration/test_operator_ha.py."""

import asyncio
import contextlib
import itertools
from dataclasses import replace

import pytest
from disagg_operator.leader import ElectionSettings, LeaderElector, LeaseRecord

LEASE = 0.4


class MemoryLeaseStore:
    def __init__(self) -> None:
        self.record: LeaseRecord | None = None
        self.versions = itertools.count(1)
        self.failing: set[str] = set()  # identities whose calls fail (a partitioned replica)

    def _check(self, record: LeaseRecord) -> None:
        if record.holder in self.failing:
            raise ConnectionError("the API server is out of reach")

    async def get(self) -> LeaseRecord | None:
        return self.record

    async def create(self, record: LeaseRecord) -> bool:
        self._check(record)
        if self.record is not None:
            return False
        self.record = replace(record, version=str(next(self.versions)))
        return True

    async def update(self, record: LeaseRecord) -> bool:
        self._check(record)
        if self.record is None or record.version != self.record.version:
            return False
        self.record = replace(record, version=str(next(self.versions)))
        return True


def settings(name: str) -> ElectionSettings:
    return ElectionSettings(name, lease_seconds=LEASE, renew_deadline_seconds=0.25,
                            retry_seconds=0.05)


async def until(condition, timeout: float = 5.0) -> float:  # type: ignore[no-untyped-def]
    loop = asyncio.get_running_loop()
    began = loop.time()
    while not condition():
        assert loop.time() - began < timeout, "condition not reached"
        await asyncio.sleep(0.01)
    return loop.time() - began


async def test_one_leads_and_a_standby_takes_over_only_after_the_lease_expires() -> None:
    store = MemoryLeaseStore()
    a, b = LeaderElector(store, settings("a")), LeaderElector(store, settings("b"))
    task_a = asyncio.create_task(a.run())
    await until(a.leading.is_set)
    task_b = asyncio.create_task(b.run())
    await asyncio.sleep(3 * LEASE)  # a renews: b never gets it
    assert not b.leading.is_set() and store.record is not None and store.record.holder == "a"
    task_a.cancel()  # a dies without releasing
    waited = await until(b.leading.is_set)
    assert waited >= LEASE * 0.8  # not before a's lease could have run out
    assert store.record is not None and store.record.holder == "b"
    assert store.record.transitions == 1
    task_b.cancel()


async def test_a_leader_that_cannot_renew_stops_leading_before_the_lease_ends() -> None:
    store = MemoryLeaseStore()
    a = LeaderElector(store, settings("a"))
    task = asyncio.create_task(a.run())
    await until(a.leading.is_set)
    store.failing.add("a")
    lost_after = await until(task.done)
    assert not a.leading.is_set()
    assert lost_after < LEASE  # it stops before a standby may start


async def test_release_hands_over_at_once() -> None:
    store = MemoryLeaseStore()
    a, b = LeaderElector(store, settings("a")), LeaderElector(store, settings("b"))
    task_a = asyncio.create_task(a.run())
    await until(a.leading.is_set)
    task_b = asyncio.create_task(b.run())
    task_a.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task_a
    await a.release()
    assert store.record is not None and store.record.holder == ""
    waited = await until(b.leading.is_set)
    assert waited < LEASE / 2
    task_b.cancel()


async def test_of_two_racing_candidates_one_wins() -> None:
    store = MemoryLeaseStore()
    electors = [LeaderElector(store, settings(n)) for n in "abcd"]
    tasks = [asyncio.create_task(e.run()) for e in electors]
    await until(lambda: any(e.leading.is_set() for e in electors))
    await asyncio.sleep(2 * LEASE)
    assert sum(e.leading.is_set() for e in electors) == 1
    for task in tasks:
        task.cancel()


def test_settings_keep_client_gos_ordering() -> None:
    with pytest.raises(ValueError, match="retry < renew deadline < lease"):
        ElectionSettings("a", lease_seconds=10, renew_deadline_seconds=10, retry_seconds=2)
