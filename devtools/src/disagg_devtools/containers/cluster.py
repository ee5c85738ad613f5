"""A set of rendered manifests run together as containers on one podman network.

    async with PodmanCluster("e2e", folder) as cluster:
        cluster.claim("models")               # a PersistentVolumeClaim's folder
        await cluster.apply(manifests)        # every pod starts at once, as on a cluster
        await cluster.wait_ready(timeout=600)
        await cluster.delete_pod("x-decode-0")  # preStop, SIGTERM, SIGKILL

The kubelet loop runs in the background while the cluster is open: one `podman ps` a second
for every container's state, then each pod's probes and restarts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

from disagg_devtools.containers.kubelet import RunningPod, Stores
from disagg_devtools.containers.podman import container_logs, container_states, podman
from disagg_devtools.containers.pods import PodPlan, workload_pods

TICK_SECONDS = 1.0
log = logging.getLogger("disagg_devtools.containers")


class PodsNotReady(TimeoutError):
    pass


class PodmanCluster:
    def __init__(self, name: str, folder: Path, namespace: str = "default") -> None:
        self.name = name
        self.network = f"disagg-{name}"
        self.folder = folder
        self.namespace = namespace
        self.stores = Stores(claims=folder / "claims")
        self.pods: dict[str, RunningPod] = {}
        self._loop: asyncio.Task[None] | None = None
        self.loop_errors: list[str] = []
        self._closing = False

    async def __aenter__(self) -> PodmanCluster:
        self.folder.mkdir(parents=True, exist_ok=True)
        await self._remove_leftovers()
        await podman("network", "create", self.network)
        self._loop = asyncio.create_task(self._kubelet_loop())
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> None:
        self._closing = True
        if self._loop is not None:
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
        await self.save_logs()
        await asyncio.gather(*(pod.remove() for pod in self.pods.values()))
        await self._remove_leftovers()
        shutil.rmtree(Path("/dev/shm") / self.folder.name, ignore_errors=True)

    async def _remove_leftovers(self) -> None:
        """Pods and the network a killed earlier run of this name left behind."""
        for pod in (await podman("pod", "ps", "--format", "{{.Name}}", "--filter",
                                 f"label=disagg-network={self.network}")).split():
            await podman("pod", "rm", "--force", "--time", "1", pod, check=False)
        await podman("network", "rm", "--force", self.network, check=False)

    async def gateway(self) -> str:
        """The host's address on the network (where a server on the host is reached from the
        pods); it exists once a pod has joined the network."""
        return (await podman("network", "inspect", self.network, "--format",
                             "{{(index .Subnets 0).Gateway}}")).strip()

    def claim(self, name: str) -> Path:
        """The folder standing for the PersistentVolumeClaim `name` (world-writable, as a
        freshly provisioned volume that the pod's fsGroup owns)."""
        path = self.stores.claims / name
        path.mkdir(parents=True, exist_ok=True)
        path.chmod(0o777)
        return path

    async def apply(self, manifests: Iterable[Mapping[str, Any]]) -> list[RunningPod]:
        """Stores the ConfigMaps and Secrets, then starts every workload's pods at once."""
        objects = list(manifests)
        for obj in objects:
            if obj["kind"] == "ConfigMap":
                self.stores.config_maps[obj["metadata"]["name"]] = obj
            elif obj["kind"] == "Secret":
                self.stores.secrets[obj["metadata"]["name"]] = obj
        plans = workload_pods(objects, self.namespace)
        return await self.start_pods(plans)

    async def start_pods(self, plans: Iterable[PodPlan]) -> list[RunningPod]:
        started = [RunningPod(plan, self.network, self.folder, self.stores) for plan in plans]
        for pod in started:
            if pod.name in self.pods:
                raise ValueError(f"pod {pod.name} already runs")
            self.pods[pod.name] = pod
        await asyncio.gather(*(pod.start() for pod in started))
        return started

    def workload(self, name: str) -> list[RunningPod]:
        return [p for p in self.pods.values() if p.plan.workload == name]

    async def wait_ready(self, timeout: float, pods: Iterable[str] | None = None) -> float:
        """Seconds until every pod named (default: all) is ready; PodsNotReady with each
        unready pod's events and its containers' last log lines otherwise."""
        names = list(pods) if pods is not None else list(self.pods)
        began = time.monotonic()
        while time.monotonic() - began < timeout:
            self.check_loop()
            if all(self.pods[n].ready for n in names):
                return time.monotonic() - began
            await asyncio.sleep(TICK_SECONDS)
        raise PodsNotReady(await self.describe([n for n in names if not self.pods[n].ready]))

    async def describe(self, names: Iterable[str]) -> str:
        lines = [f"kubelet errors: {self.loop_errors[-5:]}"] if self.loop_errors else []
        for name in names:
            pod = self.pods[name]
            lines.append(f"pod {name} ({pod.ip}): {'; '.join(pod.events[-8:])}")
            for container in pod.containers:
                lines.append(f"--- {container} logs:\n{await pod.logs(container, 15)}")
        return "\n".join(lines)

    async def delete_pod(self, name: str) -> float:
        """The pod stopped as a kubelet deletes it; its logs, its preStop hook's time
        included, are kept. Returns the seconds the stop took."""
        pod = self.pods.pop(name)
        took = await pod.stop()
        await self.save_logs([pod])
        await pod.remove()
        return took

    async def save_logs(self, pods: Iterable[RunningPod] | None = None) -> Path:
        """Every container's whole log under <folder>/logs, kept after the pods are gone."""
        folder = self.folder / "logs"
        folder.mkdir(exist_ok=True)
        for pod in pods if pods is not None else self.pods.values():
            for container in pod.containers.values():
                text = await container_logs(container.name)
                (folder / f"{container.name}.log").write_text(text)
            (folder / f"{pod.name}.events").write_text("\n".join(pod.events) + "\n")
        return folder

    async def _kubelet_loop(self) -> None:
        """Never ends on an error (a kubelet keeps going): each is logged and kept in
        `loop_errors`, which wait_ready reports."""
        while True:
            try:
                states = await container_states("")
                await asyncio.gather(*(pod.tick(states) for pod in list(self.pods.values())))
            except asyncio.CancelledError:
                if self._closing:
                    raise
                # A cancellation from inside a round (a library's), not ours: keep going.
                self.loop_errors.append("a round was cancelled")
            except Exception as error:  # noqa: BLE001 - any failure of one round
                log.warning("kubelet round failed: %r", error)
                self.loop_errors.append(repr(error))
            await asyncio.sleep(TICK_SECONDS)

    def check_loop(self) -> None:
        """Raises when the kubelet loop is gone (waiting on pods would then wait forever)."""
        if self._loop is not None and self._loop.done():
            raise RuntimeError(f"the kubelet loop ended: {self._loop!r}; {self.loop_errors}")
