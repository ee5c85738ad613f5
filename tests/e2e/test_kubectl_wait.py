"""`kubectl apply` then `kubectl wait --for=condition=Ready` with the operator running."""

import asyncio
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disagg_devtools.emulator.sandbox import Sandbox, sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_operator.handlers import OperatorConfig
from disagg_operator.plan import ClusterAddressing

ROOT = Path(__file__).resolve().parents[2]
if shutil.which("kubectl") is None:  # a missing tool fails the run; it never skips
    pytest.fail("these tests run the real kubectl: install it (e.g. Debian's kubectl "
                "package) so that it is on PATH", pytrace=False)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Sandbox]:
    etcd = await EtcdProcess(tmp_path / "etcd").start()
    try:
        async with sandbox(tmp_path / "cluster") as box:
            await box.start_operator(OperatorConfig(
                default_image="test/serving:1", resync_seconds=1.0,
                not_ready_resync_seconds=0.5, etcd_health_ttl_seconds=0.2,
                etcd_address_overrides={
                    ClusterAddressing("default").etcd_endpoints("dsv2-lite")[0]: etcd.endpoint}))
            yield box
    finally:
        etcd.stop()


async def kubectl(box: Sandbox, *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, ["kubectl", *args], env=box.env,
                                   capture_output=True, text=True, timeout=90)


async def test_apply_then_wait_for_ready(cluster: Sandbox) -> None:
    applied = await kubectl(cluster, "apply", "-f",
                            str(ROOT / "examples/deepseek-v2-lite-1p2d.yaml"))
    assert applied.returncode == 0, applied.stderr
    waited = await kubectl(cluster, "wait", "--for=condition=Ready",
                           "disaggserving/dsv2-lite", "--timeout=60s")
    assert waited.returncode == 0, waited.stderr
    assert "condition met" in waited.stdout
    table = await kubectl(cluster, "get", "dsv")
    row = table.stdout.splitlines()[1].split()
    assert row[:4] == ["dsv2-lite", "True", "1/1", "2/2"]


async def test_wait_times_out_on_an_invalid_spec(cluster: Sandbox, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    # Valid for the schema, refused by the cross-field rule the operator checks.
    bad.write_text("apiVersion: serving.disagg.dev/v1alpha1\nkind: DisaggServing\n"
                   "metadata: {name: dsv2-lite}\n"
                   "spec: {model: {name: m}, etcd: {mode: External}}\n")
    assert (await kubectl(cluster, "apply", "-f", str(bad))).returncode == 0
    reason = await kubectl(cluster, "wait", "--for=jsonpath={.status.conditions[0].reason}"
                           "=InvalidSpec", "disaggserving/dsv2-lite", "--timeout=30s")
    assert reason.returncode == 0, reason.stderr
    waited = await kubectl(cluster, "wait", "--for=condition=Ready",
                           "disaggserving/dsv2-lite", "--timeout=2s")
    assert waited.returncode != 0
    assert "timed out" in waited.stderr
