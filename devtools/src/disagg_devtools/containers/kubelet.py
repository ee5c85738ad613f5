"""One pod's life on podman, as a kubelet lives it: volumes prepared, a pod sandbox on the
network with the pod's DNS names, each container created with the pod's securityContext,
environment and mounts, then probes (startup, then liveness and readiness), restarts of exited
or unhealthy containers (restartPolicy Always, with back-off), and a stop that runs each
container's preStop hook within the grace period before SIGTERM and, at its end, SIGKILL.

Not done (a cluster does them; nothing here depends on them): Service endpoints that follow
readiness (a Service name resolves to its pods whether they are ready or not), resource
requests and CPU limits (memory limits are applied), init containers."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from disagg_operator.quantity import parse_quantity

from disagg_devtools.containers.podman import container_logs, exec_in, pod_ip, podman
from disagg_devtools.containers.pods import (
    PodFacts,
    PodPlan,
    UnsupportedObject,
    command_line,
    container_env,
    object_data,
)

MAX_BACKOFF = 20.0


@dataclass
class ContainerState:
    name: str  # the podman container's name: <pod>-<container>
    spec: Mapping[str, Any]
    started: bool = False  # its startup probe passed (or it has none)
    ready: bool = False
    restarts: int = 0
    failures: dict[str, int] = field(default_factory=dict)  # in a row, by probe kind
    verdicts: dict[str, bool] = field(default_factory=dict)  # by probe kind
    last_probe: dict[str, float] = field(default_factory=dict)
    restart_at: float | None = None  # when an exited container is started again


@dataclass
class Stores:
    """What pods read from the cluster: ConfigMaps and Secrets by name, claims' folders."""

    config_maps: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    secrets: dict[str, Mapping[str, Any]] = field(default_factory=dict)
    claims: Path = Path("/nonexistent")


class RunningPod:
    def __init__(self, plan: PodPlan, network: str, folder: Path, stores: Stores) -> None:
        self.plan = plan
        self.network = network
        self.folder = folder
        self.stores = stores
        self.ip = ""
        self.containers: dict[str, ContainerState] = {}
        self.events: list[str] = []  # what happened, in order, for tests and failure messages
        self._http: aiohttp.ClientSession | None = None
        self._stopping = False
        self._started = False  # all its containers created and started once

    @property
    def name(self) -> str:
        return self.plan.name

    @property
    def ready(self) -> bool:
        return bool(self.containers) and all(c.ready for c in self.containers.values())

    @property
    def restarts(self) -> int:
        return sum(c.restarts for c in self.containers.values())

    def container(self, name: str) -> ContainerState:
        return self.containers[name]

    # ---- start ---------------------------------------------------------------------------
    async def start(self) -> None:
        spec = self.plan.spec
        mounts = self._prepare_volumes()
        create = ["pod", "create", "--name", self.name, "--network", self.network,
                  "--label", f"disagg-network={self.network}",
                  "--hostname", self.plan.hostname or self.name]
        for dns_name in self.plan.dns_names:
            create += ["--network-alias", dns_name]
        await podman(*create)
        await podman("pod", "start", self.name)
        self.ip = await pod_ip(self.name, self.network)
        facts = PodFacts(self.name, self.plan.namespace, self.ip)
        for container in spec["containers"]:
            state = ContainerState(f"{self.name}-{container['name']}", container)
            await podman("create", *self._create_args(container, facts, mounts))
            self.containers[container["name"]] = state
        for state in self.containers.values():
            await podman("start", state.name)
            state.started = "startupProbe" not in state.spec
            self.events.append(f"started {state.name}")
        self._started = True

    def _prepare_volumes(self) -> dict[str, tuple[Path, bool]]:
        """volume name -> (host folder, read-only)."""
        group = self.plan.spec.get("securityContext", {}).get("fsGroup")
        volumes: dict[str, tuple[Path, bool]] = {}
        for volume in self.plan.spec.get("volumes", []):
            name = volume["name"]
            if "emptyDir" in volume:
                memory = volume["emptyDir"].get("medium") == "Memory"
                base = Path("/dev/shm") / self.folder.name if memory else self.folder
                path = base / "pods" / self.name / name
                path.mkdir(parents=True, exist_ok=True)
                path.chmod(0o777)  # as a kubelet makes an emptyDir
                volumes[name] = (path, False)
            elif "configMap" in volume or "secret" in volume:
                source = volume.get("configMap") or volume["secret"]
                store = self.stores.config_maps if "configMap" in volume else self.stores.secrets
                key = source.get("name") or source["secretName"]
                if key not in store and not source.get("optional"):
                    raise UnsupportedObject(f"pod {self.name}: volume {name} names {key}, "
                                            "which does not exist")
                path = self.folder / "pods" / self.name / name
                _write_files(path, object_data(store.get(key, {})), source.get("items"),
                             int(source.get("defaultMode", 0o644)), group)
                volumes[name] = (path, True)
            elif "persistentVolumeClaim" in volume:
                claim = self.stores.claims / volume["persistentVolumeClaim"]["claimName"]
                if not claim.is_dir():
                    raise UnsupportedObject(f"pod {self.name}: claim {claim.name} has no folder")
                volumes[name] = (claim, bool(volume["persistentVolumeClaim"].get("readOnly")))
            else:
                raise UnsupportedObject(f"pod {self.name}: volume {name} kind not supported")
        return volumes

    def _create_args(self, container: Mapping[str, Any], facts: PodFacts,
                     volumes: Mapping[str, tuple[Path, bool]]) -> list[str]:
        pod_security = self.plan.spec.get("securityContext", {})
        security = {**pod_security, **container.get("securityContext", {})}
        env = container_env(container, facts, self.stores.secrets, self.stores.config_maps)
        entrypoint, args = command_line(container, env)
        env_file = self.folder / "pods" / self.name / f"{container['name']}.env"
        env_file.parent.mkdir(parents=True, exist_ok=True)
        env_file.touch(mode=0o600)
        env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        create = ["--pod", self.name, "--name", f"{self.name}-{container['name']}",
                  "--env-file", str(env_file)]
        if security.get("allowPrivilegeEscalation") is False:
            create += ["--security-opt", "no-new-privileges"]
        if "runAsUser" in security:
            create += ["--user", f"{security['runAsUser']}:{security.get('runAsGroup', 0)}"]
        if "fsGroup" in pod_security:
            create += ["--group-add", str(pod_security["fsGroup"])]
        if security.get("readOnlyRootFilesystem"):
            # A cluster adds no writable /tmp under a read-only root; podman would.
            create += ["--read-only", "--read-only-tmpfs=false"]
        capabilities = security.get("capabilities", {})
        create += [a for cap in capabilities.get("drop", []) for a in ("--cap-drop", cap)]
        create += [a for cap in capabilities.get("add", []) for a in ("--cap-add", cap)]
        memory = container.get("resources", {}).get("limits", {}).get("memory")
        if memory is not None:
            create += ["--memory", str(int(parse_quantity(memory)))]
        for mount in container.get("volumeMounts", []):
            host, read_only = volumes[mount["name"]]
            if "subPath" in mount:
                host = host / mount["subPath"]
            flag = "ro" if read_only or mount.get("readOnly") else "rw"
            create += ["--volume", f"{host}:{mount['mountPath']}:{flag}"]
        if "workingDir" in container:
            create += ["--workdir", container["workingDir"]]
        if entrypoint is not None:
            create += ["--entrypoint", json.dumps(entrypoint)]
        return [*create, container["image"], *args]

    # ---- probes and restarts ---------------------------------------------------------------
    async def tick(self, states: Mapping[str, Mapping[str, Any]]) -> None:
        """One round of the kubelet's loop; `states`: podman's view of every container."""
        if self._stopping or not self._started:
            return
        now = time.monotonic()
        for state in self.containers.values():
            seen = states.get(state.name, {})
            if not seen.get("running"):
                await self._restart_exited(state, seen, now)
                continue
            if not state.started:
                if await self._probe_due(state, "startupProbe", now):
                    state.started = True
                continue
            if "livenessProbe" in state.spec and not await self._probe_due(
                    state, "livenessProbe", now):
                self.events.append(f"liveness failed {state.name}")
                await podman("kill", "--signal", "KILL", state.name, check=False)
                continue
            if "readinessProbe" in state.spec:
                ready = await self._probe_due(state, "readinessProbe", now)
                if ready != state.ready:
                    self.events.append(f"{'ready' if ready else 'not ready'} {state.name}")
                state.ready = ready
            elif not state.ready:
                state.ready = True
                self.events.append(f"ready {state.name}")

    async def _restart_exited(self, state: ContainerState, seen: Mapping[str, Any],
                              now: float) -> None:
        if state.restart_at is None:
            delay = min(MAX_BACKOFF, 2.0 ** state.restarts)
            state.restart_at = now + delay
            self.events.append(f"exited {state.name} code {seen.get('exit_code')}, "
                               f"restart in {delay:.0f} s")
            state.ready = False
            state.started = "startupProbe" not in state.spec
            state.failures.clear()
            state.verdicts.clear()
            state.last_probe.clear()
        elif now >= state.restart_at:
            state.restart_at = None
            state.restarts += 1
            await podman("start", state.name, check=False)
            self.events.append(f"restarted {state.name} ({state.restarts})")

    async def _probe_due(self, state: ContainerState, kind: str, now: float) -> bool:
        """The probe's verdict, probing again when its period has passed: it turns false
        after failureThreshold failures in a row and true at the first success (a liveness
        probe starts true, the others false). A startup probe that runs out kills the
        container, which is then restarted."""
        probe = state.spec[kind]
        verdict = state.verdicts.setdefault(kind, kind == "livenessProbe")
        if now - state.last_probe.get(kind, -1e9) < probe.get("periodSeconds", 10):
            return verdict
        state.last_probe[kind] = now
        if await self._probe(state, probe):
            state.failures[kind] = 0
            state.verdicts[kind] = True
            return True
        state.failures[kind] = state.failures.get(kind, 0) + 1
        if state.failures[kind] >= probe.get("failureThreshold", 3):
            state.verdicts[kind] = False
            if kind == "startupProbe":
                self.events.append(f"startup failed {state.name}")
                await podman("kill", "--signal", "KILL", state.name, check=False)
        return state.verdicts[kind]

    async def _probe(self, state: ContainerState, probe: Mapping[str, Any]) -> bool:
        timeout = float(probe.get("timeoutSeconds", 1))
        if "exec" in probe:
            return await exec_in(state.name, probe["exec"]["command"], timeout) == 0
        ports = {p.get("name"): p["containerPort"] for p in state.spec.get("ports", [])}
        action = probe.get("httpGet") or probe.get("tcpSocket") or {}
        port = ports.get(action.get("port"), action.get("port"))
        if "tcpSocket" in probe:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(self.ip, port),
                                                   timeout)
            except (OSError, TimeoutError):
                return False
            writer.close()
            return True
        if self._http is None:
            self._http = aiohttp.ClientSession()
        url = f"http://{self.ip}:{port}{action.get('path', '/')}"
        try:
            async with self._http.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as got:
                return 200 <= got.status < 400
        except (aiohttp.ClientError, TimeoutError):
            return False

    # ---- stop ------------------------------------------------------------------------------
    async def stop(self) -> float:
        """Stops the pod as a kubelet deletes one: preStop hooks, then SIGTERM, then SIGKILL
        at the end of the grace period (remove() then deletes it). Returns the seconds it
        took."""
        self._stopping = True
        began = time.monotonic()
        grace = float(self.plan.spec.get("terminationGracePeriodSeconds", 30))
        for state in self.containers.values():
            state.ready = False

        async def stop_one(state: ContainerState) -> None:
            hook = state.spec.get("lifecycle", {}).get("preStop", {}).get("exec")
            if hook:
                code = await exec_in(state.name, hook["command"], grace)
                self.events.append(f"preStop {state.name} exit {code}")
            left = max(1, int(grace - (time.monotonic() - began)))
            await podman("stop", "--time", str(left), state.name, check=False,
                         timeout=left + 30)

        await asyncio.gather(*(stop_one(s) for s in self.containers.values()))
        return time.monotonic() - began

    async def remove(self) -> None:
        self._stopping = True
        await podman("pod", "rm", "--force", "--time", "1", self.name, check=False,
                     timeout=60)
        if self._http is not None:
            await self._http.close()
        shutil.rmtree(Path("/dev/shm") / self.folder.name / "pods" / self.name,
                      ignore_errors=True)

    async def logs(self, container: str, tail: int = 40) -> str:
        return await container_logs(f"{self.name}-{container}", tail)


def _write_files(folder: Path, files: Mapping[str, bytes], items: list[dict[str, Any]] | None,
                 mode: int, group: int | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    chosen = ({i["path"]: files[i["key"]] for i in items if i["key"] in files} if items
              else files)
    for relative, content in chosen.items():
        path = folder / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
        path.chmod(mode)
        if group is not None:
            os.chown(path, 0, group)  # the kubelet gives volume files the pod's fsGroup
    folder.chmod(0o755)
