"""`disagg-operator run` stops on SIGTERM as a pod's container must: within seconds, exit code 0,
and a leader gives its Lease back so that a standby takes over at once. (kopf waited forever
for a thread blocked on the stop flag that nothing set, so every operator pod stop took its
whole grace period and ended in SIGKILL.)"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kmock
import pytest
from disagg_devtools.emulator.sandbox import WATCHED, sandbox
from disagg_devtools.processes import stop_process
from disagg_devtools.waiting import wait_for

from .conftest import NAMESPACE

LEASES = kmock.resource("coordination.k8s.io", "v1", "leases")


@pytest.mark.parametrize("leader_election", [False, True], ids=["single", "leader"])
async def test_the_operator_exits_within_5_s_of_sigterm(tmp_path: Path,
                                                        leader_election: bool) -> None:
    async with sandbox(tmp_path / "cluster") as box:
        env = {**os.environ, "KUBECONFIG": str(box.kubeconfig), "POD_NAMESPACE": NAMESPACE}
        argv = [sys.executable, "-m", "disagg_operator.cli", "run", "--metrics-port=0",
                "--health-port=0"]
        if leader_election:
            argv += ["--leader-election", "--leader-id", "op-a", "--lease-seconds=15"]
        with (tmp_path / "operator.log").open("wb") as log:
            operator = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            # Running: every watch open (a SIGTERM in the middle of kopf's start-up can meet
            # its 5 s wait for the tasks it spawned).
            await wait_for(lambda: box.watch_count() >= len(WATCHED), 30,
                           "the operator to watch every kind")
            if leader_election:
                await wait_for(lambda: _holder(box) == "op-a", 30, "op-a to lead")
            sent = time.monotonic()
            operator.send_signal(signal.SIGTERM)
            code = await asyncio.to_thread(_wait, operator, 30)
            took = time.monotonic() - sent
        finally:
            stop_process(operator)
        text = (tmp_path / "operator.log").read_text()
        print(f"exit {code} {took:.1f} s after SIGTERM")
        assert code == 0 and took <= 5, (code, took, text[-6000:])
        if leader_election:
            assert _holder(box) == "", "the Lease was not given back"


def _holder(box) -> str | None:  # type: ignore[no-untyped-def]
    key = (LEASES, NAMESPACE, "disagg-operator")
    objects = box.emulator.objects
    if key not in objects or objects[key].deleted:
        return None
    return str(objects[key].raw.get("spec", {}).get("holderIdentity") or "")


def _wait(process: subprocess.Popen[bytes], seconds: float) -> int | None:
    try:
        return process.wait(seconds)
    except subprocess.TimeoutExpired:
        return None


async def test_a_replica_that_cannot_start_exits_without_holding_the_lease(tmp_path: Path) -> None:
    """Its metrics port taken: the replica took the Lease, then its start-up failed, and it
    held the Lease while never reconciling. It now exits at once, naming the port, and a
    standby can lead."""
    import socket

    taken = socket.socket()
    taken.bind(("0.0.0.0", 0))
    taken.listen()
    port = taken.getsockname()[1]
    async with sandbox(tmp_path / "cluster") as box:
        env = {**os.environ, "KUBECONFIG": str(box.kubeconfig), "POD_NAMESPACE": NAMESPACE}
        argv = [sys.executable, "-m", "disagg_operator.cli", "run", f"--metrics-port={port}",
                "--health-port=0", "--leader-election", "--leader-id", "op-a",
                "--lease-seconds=15"]
        with (tmp_path / "operator.log").open("wb") as log:
            operator = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = await asyncio.to_thread(_wait, operator, 30)
        finally:
            stop_process(operator)
            taken.close()
        text = (tmp_path / "operator.log").read_text()
        assert code not in (None, 0), text[-3000:]
        assert f"--metrics-port {port}" in text, text[-3000:]
        assert not _holder(box), "a replica that cannot serve holds the Lease"
