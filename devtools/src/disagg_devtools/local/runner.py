"""Start and stop a DisaggServing as processes on this machine.

`up` starts etcd (when managed), the Mooncake master, every prefill and decode vLLM server with
its registrar, and the proxy; waits until each is ready, printing progress; and returns the
proxy's URL. Every process gets its own session, so they outlive the command, and is recorded
in the run folder's `state.json` as soon as it starts, so that `down` can stop it by PID even
when `up` failed half-way. Each process logs to `logs/<name>.log` in the run folder.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from disagg_operator.plan import VLLM_ROLES, Plan, build_plan, compatibility_fingerprint
from disagg_operator.spec import DisaggServingSpec

from disagg_devtools import processes
from disagg_devtools.etcd_process import EtcdProcess
from disagg_devtools.local.commands import (
    LOOPBACK,
    LocalAddressing,
    LocalProcess,
    Programs,
    assign_ports,
    local_processes,
)
from disagg_devtools.processes import free_port

Echo = Callable[[str], None]
STATE_FILE = "state.json"
# Each process runs under a shell that writes its exit code to a file when it ends, so that
# `local status` can say how a process that outlived `local up` ended.
RECORD_EXIT = ("sh", "-c", 'code_file="$1"; shift; "$@"; code=$?; echo "$code" > "$code_file"; '
               'exit "$code"', "record-exit")
# vLLM's CPU build reserves this much KV cache per instance by default; small models need less.
DEFAULT_CPU_KV_SPACE_GIB = "1"


class StartupError(RuntimeError):
    """A process could not start; the message names it and quotes the end of its log."""


@dataclass
class RunFolder:
    root: Path

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def config(self) -> Path:
        return self.root / "config"

    @property
    def state(self) -> Path:
        return self.root / STATE_FILE

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"

    def exit_file(self, name: str) -> Path:
        return self.root / "exit" / f"{name}.code"

    def read_state(self) -> dict[str, object]:
        try:
            state = json.loads(self.state.read_text())
        except FileNotFoundError:
            return {}
        return state if isinstance(state, dict) else {}

    def write_state(self, state: Mapping[str, object]) -> None:
        self.state.write_text(json.dumps(state, indent=2) + "\n")


@dataclass
class Started:
    spec: LocalProcess
    process: subprocess.Popen[bytes]
    log: Path
    ready: bool = False


@dataclass
class LocalDeployment:
    name: str
    spec: DisaggServingSpec
    folder: RunFolder
    python: str = sys.executable
    proxy_port: int | None = None  # default: the spec's proxy Service port
    extra_env: dict[str, str] = field(default_factory=dict)
    echo: Echo = print
    started: list[Started] = field(default_factory=list)
    etcd: EtcdProcess | None = None  # the managed etcd, when this deployment runs one

    async def up(self, timeout: float = 600.0) -> str:
        """Start everything and wait until the proxy routes to every instance; returns its URL.
        On failure everything started so far is stopped again."""
        if live := live_pids(self.folder):
            dead = dead_summary(process_reports(self.folder))
            raise StartupError(f"{self.folder.root} already runs {len(live)} processes"
                               + (f" ({dead})" if dead else "")
                               + ": run `local down` on it first, or pick another --run-dir")
        self.folder.logs.mkdir(parents=True, exist_ok=True)
        self.folder.config.mkdir(parents=True, exist_ok=True)
        proxy_port = self.proxy_port or self.spec.proxy.service.port
        ensure_free(proxy_port, "the proxy port (spec.proxy.service.port, or --proxy-port)")
        state: dict[str, object] = {"name": self.name, "pids": {}}
        self.folder.write_state(state)
        try:
            etcd = await self._etcd(state)
            return await self._start_all(etcd, proxy_port, state, timeout)
        except BaseException:
            self.echo("start-up failed; stopping what was started")
            stop_recorded(self.folder, self.echo)
            raise

    async def _etcd(self, state: dict[str, object]) -> tuple[str, ...]:
        if self.spec.etcd.mode != "Managed":
            return tuple(self.spec.etcd.endpoints)
        self.echo("starting etcd")
        etcd = self.etcd = await EtcdProcess(self.folder.root / "etcd").start()
        assert etcd.process is not None
        _record(self.folder, state, "etcd", etcd.process.pid)
        self.echo(f"  etcd ready at {etcd.endpoint}")
        return (etcd.endpoint,)

    async def _start_all(self, etcd: tuple[str, ...], proxy_port: int,
                         state: dict[str, object], timeout: float) -> str:
        addressing = LocalAddressing(etcd=etcd, master_port=free_port())
        # What a later rollout needs to plan the same deployment again.
        state["local"] = {"etcd": list(etcd), "master_port": addressing.master_port,
                          "proxy_port": proxy_port, "generation": 0,
                          "spec": self.spec.model_dump(mode="json", by_alias=True)}
        plan = build_plan(self.name, "local", self.spec, addressing)
        for file_name, content in plan.config_files.items():
            (self.folder.config / file_name).write_text(content)
        ports = assign_ports(plan, addressing, proxy_port, free_port)
        programs = Programs(python=self.python, binaries=local_binaries(self.python))
        processes = local_processes(plan, ports, self.folder.config, programs, os.environ)
        env = {**os.environ, **local_defaults(), **self.extra_env}
        # The store first: engines connect to the master as they start.
        first = [p for p in processes if p.role == "mooncake-master"]
        for batch in (first, [p for p in processes if p.role != "mooncake-master"]):
            for spec in batch:
                self._start(spec, env, state)
            await self._wait_ready(deadline=time.monotonic() + timeout)
        url = f"http://{LOOPBACK}:{proxy_port}"
        expected = sum(c.replicas for c in plan.components if c.role in ("prefill", "decode"))
        await self._wait_registered(url, expected, time.monotonic() + 60)
        return url

    def _start(self, spec: LocalProcess, env: Mapping[str, str],
               state: dict[str, object]) -> None:
        log = self.folder.log(spec.name)
        # A process group of its own, so that stopping reaches its children, but not a session:
        # under the kernel's autogroup scheduling each session is one scheduling group, and a
        # vLLM instance busy-waiting for KV then starved the other instances for tens of seconds
        # (the prefill could not serve its pages; Mooncake clients missed their heartbeats).
        exit_file = self.folder.exit_file(spec.name)
        exit_file.parent.mkdir(parents=True, exist_ok=True)
        exit_file.unlink(missing_ok=True)
        with log.open("ab") as out:
            process = subprocess.Popen([*RECORD_EXIT, str(exit_file), *spec.argv],
                                       env={**env, **spec.env}, stdout=out,
                                       stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       process_group=0)
        self.started.append(Started(spec, process, log))
        _record(self.folder, state, spec.name, process.pid,
                {"port": spec.port, "health_path": spec.health_path, "role": spec.role,
                 "pre_stop": list(spec.pre_stop), "stop_grace": spec.stop_grace})
        self.echo(f"  started {spec.name} (pid {process.pid}"
                  + (f", port {spec.port})" if spec.port else ")"))

    async def _wait_ready(self, deadline: float) -> None:
        last_report = time.monotonic()
        began = last_report
        while True:
            self._check_alive()
            for item in self.started:
                if not item.ready and await asyncio.to_thread(_is_ready, item.spec):
                    item.ready = True
                    if item.spec.port is not None:  # sidecars have nothing to wait for
                        self.echo(f"  {item.spec.name} ready after "
                                  f"{time.monotonic() - began:.0f}s")
            waiting = [i.spec.name for i in self.started if not i.ready and i.spec.port]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise StartupError(f"not ready in time: {', '.join(waiting)}; see their logs in "
                                   f"{self.folder.logs}")
            if time.monotonic() - last_report > 15:
                last_report = time.monotonic()
                self.echo(f"  waiting for {', '.join(waiting)} "
                          f"({last_report - began:.0f}s)")
            await asyncio.sleep(0.5)

    def _check_alive(self) -> None:
        for item in self.started:
            if item.process.poll() is not None:
                raise StartupError(
                    f"{item.spec.name} exited with code {item.process.returncode} during "
                    f"start-up; the end of {item.log}:\n{log_tail(item.log)}")

    def find(self, name: str) -> Started:
        for item in self.started:
            if item.spec.name == name:
                return item
        raise KeyError(f"no process {name!r}; started: {[i.spec.name for i in self.started]}")

    def kill(self, name: str, sig: signal.Signals = signal.SIGKILL) -> None:
        """Stop one process (its whole session) the way a crash would, and wait for it."""
        item = self.find(name)
        _signal_group(item.process.pid, sig)
        item.process.wait(30)

    async def restart(self, name: str, timeout: float = 120.0) -> None:
        """Stop one process and start it again with the same command line and ports."""
        item = self.find(name)
        if item.process.poll() is None:
            _signal_group(item.process.pid, signal.SIGTERM)
            item.process.wait(30)
        if item.spec.port is not None:
            await _wait_port_free(item.spec.port, time.monotonic() + 30)
        self.started.remove(item)
        env = {**os.environ, **local_defaults(), **self.extra_env}
        state = self.folder.read_state()
        self._start(item.spec, env, state)
        await self._wait_ready(deadline=time.monotonic() + timeout)

    async def restart_etcd(self) -> None:
        """Stop the managed etcd (whatever state it is in) and start it again on the same ports
        and data, as its StatefulSet's pod would restart."""
        assert self.etcd is not None and self.etcd.process is not None, "no managed etcd"
        _signal_group(self.etcd.process.pid, signal.SIGCONT)
        self.etcd.stop()
        await _wait_port_free(self.etcd.client_port, time.monotonic() + 30)
        await self.etcd.start()
        assert self.etcd.process is not None
        state = self.folder.read_state()
        _record(self.folder, state, "etcd", self.etcd.process.pid)

    async def drain(self, instance: str) -> str:
        """Take one vLLM instance away as Kubernetes does with a pod: see drain_recorded."""
        env = {**os.environ, **local_defaults(), **self.extra_env}
        why = await asyncio.to_thread(drain_recorded, self.folder, instance, self.echo, env)
        self.started = [i for i in self.started
                        if i.spec.name not in (instance, f"{instance}-registrar")]
        return why

    async def rollout(self, new_spec: DisaggServingSpec, timeout: float = 600.0,
                      strategy: Literal["RollingUpdate", "Recreate"] = "RollingUpdate"
                      ) -> list[str]:
        """Move prefill and decode to `new_spec` the way the operator's Deployments do
        (maxUnavailable 0, each new pod ready only once its registrar's peer check passes):
        new instances start beside the old ones; once the proxy routes to new instances of
        both roles with the new KV fingerprint, the old instances are drained one by one.
        `Recreate` drains the old instances first, as Kubernetes' strategy of that name does
        (requests meanwhile have no instance). Returns the drained instances. Changes beyond
        prefill and decode (the proxy, the store, their shared config) are refused: those
        restart processes clients talk to."""
        state = self.folder.read_state()
        local = state.get("local")
        if not isinstance(local, dict):
            raise StartupError(f"{self.folder.root} records no running deployment: start it "
                               "with `local up` first")
        addressing = LocalAddressing(tuple(local["etcd"]), int(local["master_port"]))
        old_spec = DisaggServingSpec.model_validate(local["spec"])
        old_plan = build_plan(self.name, "local", old_spec, addressing)
        new_plan = build_plan(self.name, "local", new_spec, addressing)
        if problem := outside_vllm_roles(old_plan, new_plan):
            raise StartupError(f"this change {problem}, which a rollout here does not "
                               "restart: run `local down` and `local up` with the new spec")
        hooks = state.get("readiness") or {}
        assert isinstance(hooks, dict)
        old_instances = [name for name, hook in hooks.items()
                         if hook.get("role") in VLLM_ROLES and hook.get("port")]
        generation = int(local["generation"]) + 1
        ports = assign_ports(new_plan, addressing, int(local["proxy_port"]), free_port)
        programs = Programs(python=self.python, binaries=local_binaries(self.python))
        skip = frozenset(c.role for c in new_plan.components) - set(VLLM_ROLES)
        started = local_processes(new_plan, ports, self.folder.config, programs, os.environ,
                                  skip_roles=frozenset(skip), generation=generation)
        env = {**os.environ, **local_defaults(), **self.extra_env}
        self.echo(f"rolling out generation {generation}: {len(started)} new processes beside "
                  f"{len(old_instances)} old instances")
        deadline = time.monotonic() + timeout
        if strategy == "Recreate":
            for instance in old_instances:
                await self.drain(instance)
            state = self.folder.read_state()
        for process in started:
            self._start(process, env, state)
        await self._wait_ready(deadline)
        fingerprint = compatibility_fingerprint(new_spec)
        wanted = {str(c.role): c.replicas for c in new_plan.components if c.role in VLLM_ROLES}
        await self._wait_fingerprint(f"http://{LOOPBACK}:{local['proxy_port']}", fingerprint,
                                     wanted, deadline)
        if strategy == "RollingUpdate":
            for instance in old_instances:
                await self.drain(instance)
        state = self.folder.read_state()
        state["local"] = {**local, "generation": generation,
                          "spec": new_spec.model_dump(mode="json", by_alias=True)}
        self.folder.write_state(state)
        self.spec = new_spec
        return old_instances

    async def _wait_fingerprint(self, url: str, fingerprint: str, wanted: Mapping[str, int],
                                deadline: float) -> None:
        """The proxy routes to `wanted` healthy instances per role of `fingerprint`."""
        while True:
            try:
                seen = json.loads(await asyncio.to_thread(_get, f"{url}/instances"))
            except (OSError, ValueError):
                seen = []
            have = {role: sum(1 for i in seen if i.get("role") == role and i.get("healthy")
                              and i.get("fingerprint") == fingerprint) for role in wanted}
            if all(have[role] >= count for role, count in wanted.items()):
                self.echo(f"  the proxy routes to new instances ({have})")
                return
            self._check_alive()
            if time.monotonic() > deadline:
                raise StartupError(f"the proxy sees {have} of {dict(wanted)} instances of "
                                   f"fingerprint {fingerprint}; see the logs in "
                                   f"{self.folder.logs}")
            await asyncio.sleep(0.5)

    async def _wait_registered(self, url: str, expected: int, deadline: float) -> None:
        """The proxy sees every instance through etcd: the registrars did their job."""
        while True:
            try:
                seen = json.loads(await asyncio.to_thread(_get, f"{url}/instances"))
            except (OSError, ValueError):
                seen = []
            healthy = [i for i in seen if i.get("healthy")]
            if len(healthy) >= expected:
                self.echo(f"  proxy routes to {len(healthy)} instances")
                return
            self._check_alive()
            if time.monotonic() > deadline:
                raise StartupError(f"the proxy sees {len(healthy)} of {expected} instances; "
                                   f"see the registrar logs in {self.folder.logs}")
            await asyncio.sleep(0.5)


async def _wait_port_free(port: int, deadline: float) -> None:
    while True:
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((LOOPBACK, port))
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise StartupError(f"port {port} is still taken") from None
        await asyncio.sleep(0.1)


def outside_vllm_roles(old: Plan, new: Plan) -> str | None:
    """What differs between two plans beyond the prefill and decode instances, or None."""
    if old.config_files != new.config_files:
        return f"changes the shared config files ({', '.join(sorted(new.config_files))})"
    others = {c.role: c for c in old.components if c.role not in VLLM_ROLES}
    changed = [c.role for c in new.components
               if c.role not in VLLM_ROLES and others.pop(c.role, None) != c]
    changed += list(others)  # components the new spec no longer has
    return f"changes {', '.join(sorted(changed))}" if changed else None


def local_defaults() -> dict[str, str]:
    """Settings a pod gets from its image or node, for processes sharing this machine."""
    return {
        # Mooncake's TCP transport listens on every interface unless told otherwise.
        "MC_TCP_BIND_ADDRESS": LOOPBACK,
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE",
                                                 DEFAULT_CPU_KV_SPACE_GIB),
    }


def share_cores(threads: int) -> None:
    """Give every vLLM engine this process starts afterwards `threads` OpenMP threads that the
    kernel places; 0 keeps vLLM's own binding. vLLM's CPU build binds an instance's threads to
    every core of its NUMA node, so instances sharing a small machine each need all its cores
    at once for every parallel region and wait on one another's busy threads (benchmarks on 2
    cores: TTFT p50 about 3x higher, and far noisier, with 3 instances)."""
    if threads > 0:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"
        os.environ["OMP_NUM_THREADS"] = str(threads)


def local_binaries(python: str) -> dict[str, str]:
    """Programs the plan names, found beside the serving Python first."""
    found = {}
    for program in ("mooncake_master", "mooncake_client", "etcd"):
        path = shutil.which(program, path=str(Path(python).parent)) or shutil.which(program)
        if path:
            found[program] = path
    return found


def ensure_free(port: int, what: str) -> None:
    with socket.socket() as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            raise StartupError(f"port {port} is taken: {what}. Stop what listens there or "
                               "choose another port") from None


def log_tail(path: Path, lines: int = 25) -> str:
    return processes.log_tail(path, lines, indent="    ")


def _record(folder: RunFolder, state: dict[str, object], name: str, pid: int,
            readiness: dict[str, object] | None = None) -> None:
    pids = state["pids"]
    assert isinstance(pids, dict)
    pids[name] = pid
    if readiness is not None:
        checks = state.setdefault("readiness", {})
        assert isinstance(checks, dict)
        checks[name] = readiness
    folder.write_state(state)


@dataclass(frozen=True)
class ProcessReport:
    """One recorded process as `local status` shows it."""
    name: str
    pid: int
    alive: bool
    exit_code: int | None  # when it has exited and its wrapper recorded the code
    ready: bool | None  # None: not alive, or no readiness check known

    def describe(self) -> str:
        if self.alive:
            state = {True: "ready", False: "not ready", None: "running"}[self.ready]
            return f"{state} (pid {self.pid})"
        if self.exit_code is None:
            return "exited (no exit code recorded)"
        if self.exit_code > 128:
            return f"killed by signal {self.exit_code - 128}"
        return f"exited with code {self.exit_code}"


def process_reports(folder: RunFolder) -> list[ProcessReport]:
    state = folder.read_state()
    pids = state.get("pids") or {}
    checks = state.get("readiness") or {}
    assert isinstance(pids, dict) and isinstance(checks, dict)
    _reap()
    reports = []
    for name, pid in pids.items():
        alive = _alive(int(pid))
        code: int | None = None
        if not alive:
            try:
                code = int(folder.exit_file(name).read_text().strip())
            except (FileNotFoundError, ValueError):
                code = None
        ready = None
        check = checks.get(name)
        if alive and isinstance(check, dict) and check.get("port"):
            ready = _is_ready(LocalProcess(name=name, role="", argv=(),
                                           port=int(check["port"]),
                                           health_path=check.get("health_path")))
        reports.append(ProcessReport(name, int(pid), alive, code, ready))
    return reports


def dead_summary(reports: list[ProcessReport]) -> str:
    """`a exited with code 1, b killed by signal 9`, for the processes that are gone."""
    return ", ".join(f"{r.name} {r.describe()}" for r in reports if not r.alive)


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=2) as response:
        return str(response.read().decode())


def _is_ready(spec: LocalProcess) -> bool:
    if spec.port is None:
        return True
    if spec.health_path is None:
        try:
            with socket.create_connection((LOOPBACK, spec.port), timeout=0.5):
                return True
        except OSError:
            return False
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{spec.port}{spec.health_path}",
                                    timeout=2) as response:
            return bool(response.status == 200)
    except (OSError, urllib.error.URLError):
        return False


def live_pids(folder: RunFolder) -> dict[str, int]:
    pids = folder.read_state().get("pids") or {}
    assert isinstance(pids, dict)
    return {name: int(pid) for name, pid in pids.items() if _alive(int(pid))}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stop_wave(name: str) -> int:
    """Which wave stops `name`: the store's clients (vLLM, the proxy, registrars) before the
    masters, the masters before etcd. A Mooncake client's teardown writes to etcd and waits
    5 s per write it cannot make: stopped together, the proxy outlived a 15 s grace."""
    return 2 if "etcd" in name else 1 if "mooncake-master" in name else 0


def stop_recorded(folder: RunFolder, echo: Echo, grace: float = 15.0) -> int:
    """SIGTERM every recorded process (its whole session) in waves, each wave given `grace`
    seconds before what is left of it gets SIGKILL."""
    live = live_pids(folder)
    order = sorted(live, key=_stop_wave)
    for _, wave in itertools.groupby(order, key=_stop_wave):
        group = list(wave)
        for name in group:
            _signal_group(live[name], signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(_group_alive(live[n]) for n in group) and time.monotonic() < deadline:
            _reap()
            time.sleep(0.1)
        for name in group:
            if _group_alive(live[name]):
                echo(f"  {name} did not stop in {grace:g}s; killing it")
                _signal_group(live[name], signal.SIGKILL)
        _reap()
    if folder.state.exists():
        folder.state.unlink()
    for name in order:
        echo(f"  stopped {name}")
    return len(order)


def drain_recorded(folder: RunFolder, instance: str, echo: Echo,
                   env: Mapping[str, str]) -> str:
    """Take a recorded vLLM instance away gracefully, in the order a pod deletion runs: its
    registrar gets SIGTERM (it withdraws the registration, so the proxy stops sending work),
    the instance's drain hook waits for its requests to finish, then vLLM gets SIGTERM and,
    after its grace period, SIGKILL. Returns what the drain hook said."""
    state = folder.read_state()
    pids = state.get("pids") or {}
    hooks = state.get("readiness") or {}
    assert isinstance(pids, dict) and isinstance(hooks, dict)
    if instance not in pids:
        raise StartupError(f"no instance {instance!r} in {folder.root}; recorded: "
                           f"{', '.join(sorted(pids))}")
    hook = hooks.get(instance) or {}
    grace = float(hook.get("stop_grace") or 30.0)
    registrar = pids.get(f"{instance}-registrar")
    if registrar is not None:
        _stop_group(int(registrar), 30.0)
        echo(f"  {instance}: withdrawn from the registry")
    why = "no drain hook"
    if hook.get("pre_stop"):
        try:
            done = subprocess.run(list(hook["pre_stop"]), env=dict(env), capture_output=True,
                                  text=True, timeout=grace)
            why = (done.stdout.strip().splitlines() or ["(no output)"])[-1]
        except subprocess.TimeoutExpired:
            why = f"the drain hook ran past the grace period ({grace:g}s)"
        echo(f"  {instance}: {why}")
    _stop_group(int(pids[instance]), grace)
    echo(f"  {instance}: stopped")
    for name in (instance, f"{instance}-registrar"):
        pids.pop(name, None)
        hooks.pop(name, None)
    folder.write_state(state)
    return why


def _stop_group(pid: int, grace: float) -> None:
    """SIGTERM a process group, SIGKILL it if it is still there after `grace` seconds."""
    _signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _group_alive(pid) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.1)
    if _group_alive(pid):
        _signal_group(pid, signal.SIGKILL)
    _reap()


def _group_alive(leader: int) -> bool:
    """Whether any process of the group that `leader` started still runs. The leader is the
    exit-recording shell, which SIGTERM ends at once while the program under it may still be
    shutting down (or hang doing so: vLLM's server can)."""
    if _alive(leader) and not _zombie(leader):
        return True
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
            state, _ppid, group = stat.read_text().rsplit(")", 1)[1].split()[:3]
        except (OSError, IndexError, ValueError):
            continue  # it ended while we looked
        if int(group) == leader and state != "Z":
            return True
    return False


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _reap() -> None:
    """Collect exited children of this process, so that they stop counting as alive."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        pass
