"""The plan the operator renders, turned into processes on this machine (pure: no I/O).

Every replica of every component becomes one process with the plan's own command line, with
the few things a pod gets from Kubernetes supplied locally instead:
- addresses: every listener binds loopback, and each replica gets its own ports (given by the
  caller), substituted wherever the plan names a container port;
- `$(VAR)` references in arguments, expanded from the process's env as Kubernetes does;
- the config folder (`/etc/disagg` in a pod, a folder of the run here);
- programs: `python3` is the serving Python, binaries are found beside it.
Secrets are never read from anywhere but the caller's environment.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from disagg_operator.plan import (
    CONFIG_DIR,
    VLLM_PORT,
    Component,
    EnvValue,
    Plan,
    PodIP,
    PodName,
    Process,
    SecretKey,
)

LOOPBACK = "127.0.0.1"
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")
# Paths inside a pod; locally the caller's own settings apply.
POD_ONLY_ENV = frozenset({"HF_HOME"})


@dataclass(frozen=True)
class LocalAddressing:
    """Addresses as processes on one machine see each other (the plan's `Addressing`)."""

    etcd: tuple[str, ...]
    master_port: int

    def etcd_endpoints(self, name: str) -> tuple[str, ...]:
        return self.etcd

    def mooncake_master(self, name: str, port: int) -> str:
        return f"{LOOPBACK}:{self.master_port}"

    def registration_url(self) -> str:
        # The container port, substituted per replica like every other.
        return f"http://$(POD_IP):{VLLM_PORT}"


@dataclass(frozen=True)
class LocalProcess:
    name: str  # e.g. tiny-mla-decode-1-registrar
    role: str  # the component's role
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)  # on top of the caller's environment
    port: int | None = None  # the main listener, for readiness
    health_path: str | None = None  # None: ready when the port accepts connections
    pre_stop: tuple[str, ...] = ()  # run before it is stopped: its drain (a preStop hook)
    stop_grace: float | None = None  # seconds from pre_stop to SIGKILL


@dataclass(frozen=True)
class Programs:
    python: str  # runs vLLM, the registrar and the proxy
    binaries: Mapping[str, str]  # plan program name -> path here (mooncake_master, etcd)


class LocalPlanError(ValueError):
    """The plan cannot run locally as it stands; the message says what to change."""


Ports = Mapping[tuple[str, int, str], int]


def assign_ports(plan: Plan, addressing: LocalAddressing, proxy_port: int,
                 allocate: Callable[[], int]) -> dict[tuple[str, int, str], int]:
    """A local port per (role, replica, port name): the proxy's is given, the master's is the
    one the plan's mooncake.json already names, every other comes from `allocate`."""
    fixed = {("proxy", "http"): proxy_port, ("mooncake-master", "rpc"): addressing.master_port}
    # Only the first replica's: a second master (HA mode, found through etcd) needs its own.
    return {(c.role, replica, port_name): (fixed.get((c.role, port_name)) if replica == 0
                                           else None) or allocate()
            for c in plan.components for replica in range(c.replicas)
            for port_name, _ in c.main.ports}


def local_processes(plan: Plan, ports: Ports, config_dir: Path,
                    programs: Programs, caller_env: Mapping[str, str],
                    skip_roles: frozenset[str] = frozenset({"etcd"}),
                    generation: int = 0) -> list[LocalProcess]:
    """One LocalProcess per replica and container. `ports[(role, replica, port name)]` is the
    local port of that replica's listener; roles in `skip_roles` are run by the caller.
    Instances of a later `generation` (a rollout's new ones) are named apart from the old."""
    processes: list[LocalProcess] = []
    for component in plan.components:
        if component.role in skip_roles:
            continue
        if component.nodes > 1:
            raise LocalPlanError(
                f"spec.{component.role}.nodesPerInstance is {component.nodes}: an instance "
                "spanning nodes runs on Kubernetes (a LeaderWorkerSet group); set it to 1 "
                "to run here")
        for replica in range(component.replicas):
            mapping = {container: ports[(component.role, replica, port_name)]
                       for port_name, container in component.main.ports}
            revision = f"g{generation}-" if generation else ""
            instance = f"{plan.name}-{component.role}-{revision}{replica}"
            for process in (component.main, *component.sidecars):
                processes.append(_local(component, process, instance, mapping, config_dir,
                                        programs, caller_env))
    return processes


def _local(component: Component, process: Process, instance: str, ports: Mapping[int, int],
           config_dir: Path, programs: Programs, caller_env: Mapping[str, str]) -> LocalProcess:
    if process.secret_mounts:
        raise LocalPlanError(
            f"{component.role} mounts Secret {process.secret_mounts[0].secret} (etcd.tls), "
            "which exists only in Kubernetes: remove spec.etcd.tls to run here")
    env = {name: _env_value(value, instance, process, caller_env)
           for name, value in process.env if name not in POD_ONLY_ENV}
    env.setdefault("POD_NAME", instance)
    env.setdefault("POD_IP", LOOPBACK)
    env = {name: _localise(value, ports, config_dir) for name, value in env.items()}
    argv = _local_argv(process.command, env, ports, config_dir, programs)
    is_main = process is component.main
    name = instance if is_main else f"{instance}-{process.name}"
    main_port = ports.get(process.ports[0][1]) if is_main and process.ports else None
    return LocalProcess(name=name, role=component.role, argv=argv, env=env,
                        port=main_port, health_path=process.health_path if is_main else None,
                        pre_stop=_local_argv(process.pre_stop, env, ports, config_dir, programs)
                        if process.pre_stop else (),
                        stop_grace=component.stop_grace_seconds if is_main else None)


def _local_argv(command: tuple[str, ...], env: Mapping[str, str], ports: Mapping[int, int],
                config_dir: Path, programs: Programs) -> tuple[str, ...]:
    argv = [_localise(_expand(arg, env), ports, config_dir) for arg in command]
    argv[0] = _program(argv[0], programs)
    return tuple(argv)


def _env_value(value: EnvValue, instance: str, process: Process,
               caller_env: Mapping[str, str]) -> str:
    if isinstance(value, PodIP):
        return LOOPBACK
    if isinstance(value, PodName):
        return instance
    if isinstance(value, SecretKey):
        for name, ref in process.env:
            if ref == value and name in caller_env:
                return caller_env[name]
        names = " or ".join(name for name, ref in process.env if ref == value)
        raise LocalPlanError(
            f"{value.field}: Secret {value.name}/{value.key} cannot be read outside "
            f"Kubernetes; export its value in your environment ({names}) instead")
    return value


def _expand(arg: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: known variables are replaced, others left as they are."""
    return _VAR.sub(lambda m: env.get(m[1], m[0]), arg)


def _localise(arg: str, ports: Mapping[int, int], config_dir: Path) -> str:
    arg = arg.replace("0.0.0.0", LOOPBACK).replace(CONFIG_DIR, str(config_dir))
    for container, local in ports.items():
        # A container port as a whole argument, after `=`, or after a host's `:`.
        arg = re.sub(rf"(^|[=:]){container}(?=$|/)", rf"\g<1>{local}", arg)
    return arg


def _program(program: str, programs: Programs) -> str:
    if program in ("python", "python3"):
        return programs.python
    if program in programs.binaries:
        return programs.binaries[program]
    raise LocalPlanError(f"no local program for {program!r}")
