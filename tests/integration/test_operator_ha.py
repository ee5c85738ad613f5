"""Two operator processes (`disagg-operator run --leader-election`) against the API emulator
with a real etcd: the leader is killed (SIGKILL) in the middle of its first reconcile, and the
standby, once the Lease has expired, finishes the job. Every child is written exactly once
between them, and nothing is written while no one leads."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kmock
from disagg_devtools.emulator.sandbox import sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_devtools.processes import stop_process
from disagg_devtools.waiting import wait_for

from .conftest import NAMESPACE, Api, example, managed_etcd

LEASE_SECONDS = 3.0
CHILD_PLURALS = {"deployments", "statefulsets", "services", "configmaps", "networkpolicies",
                 "poddisruptionbudgets"}
LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")


def start_operator(identity: str, kubeconfig: Path, etcd: EtcdProcess,
                   log: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "KUBECONFIG": str(kubeconfig), "POD_NAMESPACE": NAMESPACE}
    with log.open("wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "disagg_operator.cli", "run", "--leader-election",
             "--leader-id", identity, f"--lease-seconds={LEASE_SECONDS}",
             "--metrics-port=0", "--health-port=0", "--resync-seconds=1",
             f"--etcd-address={managed_etcd('dsv2-lite')}={etcd.endpoint}"],
            env=env, stdout=out, stderr=subprocess.STDOUT)


def holder(api: Api) -> str | None:
    key = (LEASES, NAMESPACE, "disagg-operator")
    if key not in api.emu.objects or api.emu.objects[key].deleted:
        return None
    return str(api.emu.objects[key].raw.get("spec", {}).get("holderIdentity") or "")


async def test_a_standby_finishes_the_killed_leaders_reconcile_without_duplicates(
        tmp_path: Path, etcd: EtcdProcess) -> None:
    async with sandbox(tmp_path / "cluster") as box:
        api = Api(box)
        # Each child write takes a while, so the kill lands between two of them.
        box.emulator.write_delays.update(dict.fromkeys(CHILD_PLURALS, 0.3))
        operators = {}
        try:
            operators["a"] = start_operator("op-a", box.kubeconfig, etcd, tmp_path / "a.log")
            await wait_for(lambda: holder(api) == "op-a", 30, "op-a to lead")
            watches = box.watch_count()
            operators["b"] = start_operator("op-b", box.kubeconfig, etcd, tmp_path / "b.log")
            await wait_for(lambda: box.watch_count() > watches, 30, "op-b to watch")

            mark = api.mark()
            await api.create(example("deepseek-v2-lite-1p2d.yaml"))

            def child_writes() -> list[tuple[float, str]]:
                """Writes of children that took effect (not one cut off by the kill)."""
                return [(r.at, r.path) for r in api.emu.request_log[mark:]
                        if r.is_write and not r.dry_run and r.plural in CHILD_PLURALS
                        and r.served]

            await wait_for(lambda: len(child_writes()) >= 3, 30, "op-a to be mid-reconcile")
            killed_at = time.monotonic()
            operators["a"].send_signal(signal.SIGKILL)
            operators["a"].wait(10)

            await wait_for(lambda: holder(api) == "op-b", 30, "op-b to take over")
            takeover = time.monotonic() - killed_at
            await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                                     timeout=60)
        finally:
            for process in operators.values():
                stop_process(process)

        writes = child_writes()
        total = len({path for _, path in writes})
        written_by_a = sum(at < killed_at for at, _ in writes)  # arrived before the kill
        print(f"op-a wrote {written_by_a} of {total} children before SIGKILL; op-b held the "
              f"lease {takeover:.1f} s after the kill (lease {LEASE_SECONDS:g} s)")
        assert written_by_a < total  # killed mid-reconcile
        repeated = [p for p, n in collections.Counter(p for _, p in writes).items() if n > 1]
        assert not repeated, repeated  # a child op-a wrote is not written again
        first_by_b = min(at for at, _ in writes if at > killed_at)
        # Nothing written between the kill and op-b's lease: a standby writes nothing.
        assert first_by_b - killed_at >= LEASE_SECONDS * 0.8
        assert LEASE_SECONDS * 0.8 <= takeover <= LEASE_SECONDS + 3
