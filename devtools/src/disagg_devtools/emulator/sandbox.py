"""An in-process cluster for demos, tests and benchmarks: the API emulator over real HTTP, a
kubeconfig pointing at it, and the operator running against it (needs the `emulator` extra).

The emulator stands in for kube-apiserver only; the operator, kubectl and etcd are real.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import kmock
import kopf
from disagg_operator.child_kinds import CHILD_KINDS
from disagg_operator.crd import build_crd
from disagg_operator.handlers import OperatorConfig, registry
from disagg_operator.spec import PLURAL

from disagg_devtools.emulator.server import ClusterEmulator, Readiness
from disagg_devtools.waiting import wait_for

# The watches kopf opens for our handlers; objects created before them would be missed.
# (An add-on kind is watched only where its CRD is installed.)
WATCHED = (PLURAL, *(child.plural for child in CHILD_KINDS if not child.optional))


def write_kubeconfig(path: Path, server_url: str, namespace: str = "default") -> Path:
    path.write_text(
        "apiVersion: v1\nkind: Config\n"
        f"clusters: [{{name: emulator, cluster: {{server: '{server_url}'}}}}]\n"
        "users: [{name: emulator, user: {token: emulator-token}}]\n"
        f"contexts: [{{name: emulator, context: {{cluster: emulator, user: emulator, "
        f"namespace: {namespace}}}}}]\n"
        "current-context: emulator\n")
    return path


class OperatorThread:
    """kopf in its own thread and event loop, as it would run in its own pod.

    kopf cancels every task spawned after it started when it stops; in a thread of its own
    that cannot touch the caller's tasks.
    """

    def __init__(self, config: OperatorConfig, namespaces: tuple[str, ...] = ()) -> None:
        self.config = config
        self.namespaces = namespaces  # none: cluster-wide, as `run` without --namespace
        self.stop_flag = threading.Event()
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread = threading.Thread(target=self._main, name="operator", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _main(self) -> None:
        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._task = asyncio.current_task()
            await kopf.operator(registry=registry, clusterwide=not self.namespaces,
                                namespaces=list(self.namespaces), standalone=True,
                                memo=kopf.Memo(config=self.config), stop_flag=self.stop_flag)
        try:
            asyncio.run(run())
        except asyncio.CancelledError:
            pass
        except BaseException as err:  # reported by is_alive()/stop()
            self.error = err

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    async def stop(self, timeout: float) -> None:
        self.stop_flag.set()
        await asyncio.to_thread(self._thread.join, timeout)
        if self._thread.is_alive() and self._loop is not None and self._task is not None:
            self._loop.call_soon_threadsafe(self._task.cancel)
            await asyncio.to_thread(self._thread.join, timeout)
        if self.error is not None:
            raise RuntimeError("the operator failed") from self.error


@dataclass
class Sandbox:
    emulator: ClusterEmulator
    server_url: str
    kubeconfig: Path
    env: dict[str, str]  # for kubectl subprocesses: KUBECONFIG, cache and HOME in workdir
    _operator: OperatorThread | None = None

    def watch_count(self) -> int:
        return sum(1 for r in self.emulator.request_log
                   if r.action == "WATCH" and r.plural in WATCHED)

    async def start_operator(self, config: OperatorConfig, timeout: float = 30.0,
                             namespaces: tuple[str, ...] = ()) -> None:
        if self._operator is not None:
            raise RuntimeError("the operator is already running")
        watches_before = self.watch_count()
        operator = self._operator = OperatorThread(config, namespaces)
        operator.start()
        await wait_for(lambda: self.watch_count() >= watches_before + len(WATCHED)
                       or not operator.is_alive(), timeout, "the operator's watches")
        if not operator.is_alive():
            self._operator = None
            raise RuntimeError("the operator stopped during start-up") from operator.error

    async def stop_operator(self, timeout: float = 15.0) -> None:
        operator, self._operator = self._operator, None
        if operator is not None:
            await operator.stop(timeout)


@contextlib.asynccontextmanager
async def sandbox(workdir: Path, readiness: Readiness = "instant",
                  host: str = "127.0.0.1") -> AsyncIterator[Sandbox]:
    """The emulator serving our CRD on `host` (loopback unless containers must reach it),
    with KUBECONFIG pointing at it for this process."""
    workdir.mkdir(parents=True, exist_ok=True)
    saved = os.environ.get("KUBECONFIG")
    async with ClusterEmulator(readiness=readiness) as emulator, \
            kmock.Server(emulator, host=host) as server:
        emulator.register_crd(build_crd())
        kubeconfig = write_kubeconfig(workdir / "kubeconfig", str(server.url))
        env = {**os.environ, "KUBECONFIG": str(kubeconfig),
               "KUBECACHEDIR": str(workdir / "kube-cache"), "HOME": str(workdir)}
        os.environ["KUBECONFIG"] = str(kubeconfig)  # kopf and lightkube log in from it
        box = Sandbox(emulator, str(server.url), kubeconfig, env)
        try:
            yield box
        finally:
            await box.stop_operator()
            if saved is None:
                os.environ.pop("KUBECONFIG", None)
            else:
                os.environ["KUBECONFIG"] = saved
