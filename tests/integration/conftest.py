"""The operator (kopf) against the API emulator over real HTTP, with a real etcd."""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import kmock
import pytest
import yaml
from disagg_devtools.emulator.metric_pages import MetricPagesServer
from disagg_devtools.emulator.sandbox import Sandbox, sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_devtools.waiting import wait_for
from disagg_operator.handlers import OperatorConfig
from disagg_operator.plan import ClusterAddressing
from disagg_operator.spec import GROUP, PLURAL, VERSION

from .stand_in_pods import metric_pages

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "default"
DSV = kmock.resource(GROUP, VERSION, PLURAL)


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "examples" / name).read_text())


def managed_etcd(name: str) -> str:
    return ClusterAddressing(NAMESPACE).etcd_endpoints(name)[0]


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdProcess]:
    proc = await EtcdProcess(tmp_path / "etcd").start()
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture
async def pages() -> AsyncIterator[MetricPagesServer]:
    """Stand-in metric pages for the serving pods of stand_in_pods.PODS."""
    async with metric_pages() as server:
        yield server


def fast_config(etcd: EtcdProcess, **settings: Any) -> OperatorConfig:
    """Fast timers; the managed etcd Services of the examples resolve to the real etcd."""
    names = ("dsv2-lite", "llama", "shared-etcd")
    return OperatorConfig(**{
        "default_image": "test/serving:1", "resync_seconds": 0.3,
        "not_ready_resync_seconds": 0.3, "debounce_seconds": 0.02,
        "error_backoff_seconds": (0.2,), "etcd_health_ttl_seconds": 0.1,
        "etcd_address_overrides": {managed_etcd(n): etcd.endpoint for n in names},
        **settings})


@pytest.fixture
def config(etcd: EtcdProcess) -> OperatorConfig:
    return fast_config(etcd)


@pytest.fixture
async def cluster(tmp_path: Path, config: OperatorConfig) -> AsyncIterator[Sandbox]:
    async with sandbox(tmp_path / "cluster") as box:
        await box.start_operator(config)
        yield box


class Api:
    """Test-side view of the emulator's stored objects and received requests."""

    def __init__(self, box: Sandbox) -> None:
        self.box = box
        self.emu = box.emulator

    def get(self, plural: str, name: str, group: str = "apps",
            version: str = "v1") -> dict[str, Any] | None:
        res = DSV if plural == PLURAL else kmock.resource(group, version, plural)
        key = (res, NAMESPACE, name)
        if key in self.emu.objects and not self.emu.objects[key].deleted:
            return copy.deepcopy(dict(self.emu.objects[key].raw))
        return None

    def dsv(self, name: str) -> dict[str, Any] | None:
        return self.get(PLURAL, name)

    def children(self, owner: str) -> dict[tuple[str, str], dict[str, Any]]:
        found = {}
        for (res, _, name), obj in self.emu.objects.items():
            if obj.deleted:
                continue
            labels = obj.raw.get("metadata", {}).get("labels") or {}
            if labels.get("app.kubernetes.io/instance") == owner:
                found[(res.plural, name)] = copy.deepcopy(dict(obj.raw))
        return found

    def condition(self, name: str, ctype: str) -> dict[str, Any] | None:
        status = (self.dsv(name) or {}).get("status") or {}
        return next((c for c in status.get("conditions") or [] if c["type"] == ctype), None)

    def writes_since(self, mark: int) -> list[str]:
        """Write requests the emulator received after request number `mark`."""
        return [f"{r.method} {r.path}" for r in self.emu.request_log[mark:]
                if r.is_write and not r.dry_run and r.plural != "events"]

    def mark(self) -> int:
        return len(self.emu.request_log)

    def events(self, reason: str | None = None) -> list[dict[str, Any]]:
        found = []
        for (res, _, _), obj in self.emu.objects.items():
            if res.plural == "events" and not obj.deleted and (
                    reason is None or obj.raw.get("reason") == reason):
                found.append(dict(obj.raw))
        return found

    async def create(self, body: dict[str, Any]) -> None:
        await self._request("POST", f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}",
                            body)

    async def patch_spec(self, name: str, spec_patch: dict[str, Any]) -> None:
        await self._request(
            "PATCH", f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/{name}",
            {"spec": spec_patch}, content_type="application/merge-patch+json")

    async def delete(self, path: str) -> None:
        await self._request("DELETE", path, None)

    async def _request(self, method: str, path: str, body: dict[str, Any] | None,
                       content_type: str = "application/json") -> None:
        import aiohttp

        async with aiohttp.ClientSession() as session, session.request(
                method, self.box.server_url.rstrip("/") + path, json=body,
                headers={"Content-Type": content_type}) as response:
            assert response.status < 300, f"{method} {path}: {response.status} " \
                                          f"{await response.text()}"

    async def wait_condition(self, name: str, ctype: str, status: str,
                             reason: str | None = None, timeout: float = 20.0,
                             generation: int | None = None) -> dict[str, Any]:
        def matches() -> bool:
            cond = self.condition(name, ctype)
            return bool(cond and cond["status"] == status
                        and (reason is None or cond["reason"] == reason)
                        and (generation is None or cond["observedGeneration"] >= generation))
        try:
            await wait_for(matches, timeout, f"{ctype}={status} ({reason}) on {name}")
        except TimeoutError as err:
            raise AssertionError(f"{err}; conditions now: {self.condition(name, ctype)}") from None
        cond = self.condition(name, ctype)
        assert cond is not None
        return cond

    async def wait(self, predicate: Callable[[], object], what: str,
                   timeout: float = 20.0) -> None:
        await wait_for(predicate, timeout, what)


@pytest.fixture
def api(cluster: Sandbox) -> Api:
    return Api(cluster)
