"""The operator image as the chart runs it: `helm install` into the API emulator, then the
Deployment helm created runs as a container (non-root, read-only root, the chart's arguments,
probes) and reconciles the seed DisaggServing to Ready. The seed's etcd, whose health the
operator reads, runs as a container from its rendered StatefulSet.

What stands in for a cluster: the API emulator on the host (reached at the podman network's
gateway) and, instead of the service-account token a kubelet mounts, a kubeconfig (the emulator
speaks plain HTTP). Runs with .venv (the emulator) as root in a network namespace of its own."""

from __future__ import annotations

import asyncio
import copy
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from disagg_devtools.containers.cluster import PodmanCluster
from disagg_devtools.containers.podman import environment, podman
from disagg_devtools.containers.pods import PodPlan
from disagg_devtools.emulator.helm import helm_install
from disagg_devtools.emulator.sandbox import Sandbox, sandbox
from disagg_operator.association import Owner
from disagg_operator.render import render_spec
from disagg_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[3]
SEED = ROOT / "tests" / "containers" / "tiny-mla-1p2d.yaml"
OPERATOR_IMAGE = "disagg-operator/operator:0.1.0"
TOOLS = Path(os.environ.get("DISAGG_TOOLS_BIN", ROOT / ".venv-tools" / "bin"))
NAMESPACE = "disagg-system"


def _seed_etcd() -> list[dict[str, Any]]:
    doc = yaml.safe_load(SEED.read_text())
    objects = render_spec(Owner(doc["metadata"]["name"], "default", "uid-e2e"),
                          parse_spec(doc["spec"]), "disagg-operator/serving:0.1.0")
    return [o for o in objects if o["kind"] in ("StatefulSet", "Service")
            and "-etcd" in o["metadata"]["name"]]


def _operator_pod(box: Sandbox) -> PodPlan:
    """The pod of the Deployment helm created, with a kubeconfig for the emulator."""
    deployment, = [dict(obj.raw) for (res, ns, _), obj in box.emulator.objects.items()
                   if res.plural == "deployments" and ns == NAMESPACE and not obj.deleted]
    template = copy.deepcopy(deployment["spec"]["template"])
    spec = template["spec"]
    operator = spec["containers"][0]
    operator.setdefault("env", []).append({"name": "KUBECONFIG",
                                           "value": "/var/run/disagg-e2e/kubeconfig"})
    operator.setdefault("volumeMounts", []).append(
        {"name": "e2e-kubeconfig", "mountPath": "/var/run/disagg-e2e", "readOnly": True})
    spec.setdefault("volumes", []).append(
        {"name": "e2e-kubeconfig", "configMap": {"name": "e2e-kubeconfig"}})
    return PodPlan("disagg-operator-0", NAMESPACE, deployment["metadata"]["name"],
                   template["metadata"].get("labels", {}), spec)


def _ready(box: Sandbox, name: str) -> bool:
    for (res, _, obj_name), obj in box.emulator.objects.items():
        if res.plural == "disaggservings" and obj_name == name and not obj.deleted:
            return any(c.get("type") == "Ready" and c.get("status") == "True"
                       for c in (obj.raw.get("status") or {}).get("conditions", []))
    return False


async def test_the_operator_image_reconciles_the_seed_to_ready(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.fail("the container e2e runs as root (podman's rootful networks)")
    if subprocess.run(["podman", "image", "exists", OPERATOR_IMAGE],
                      env=environment()).returncode != 0:
        pytest.fail(f"{OPERATOR_IMAGE} is missing: run `make images` first")
    if shutil.which("kubectl") is None:
        pytest.fail("this test runs the real kubectl: install it")
    async with PodmanCluster("operator", tmp_path / "pods") as cluster:
        await cluster.apply(_seed_etcd())
        await cluster.wait_ready(120)
        async with sandbox(tmp_path / "api", host=await cluster.gateway()) as box:
            await helm_install(box, TOOLS, namespace=NAMESPACE)
            cluster.stores.config_maps["e2e-kubeconfig"] = {
                "kind": "ConfigMap", "data": {"kubeconfig": box.kubeconfig.read_text()}}
            pod, = await cluster.start_pods([_operator_pod(box)])
            started = await cluster.wait_ready(120, [pod.name])
            container = next(iter(pod.containers.values())).name
            user, read_only = json.loads(await podman(
                "inspect", container, "--format",
                "[{{json .Config.User}}, {{.HostConfig.ReadonlyRootfs}}]"))
            applied = await asyncio.to_thread(
                subprocess.run, ["kubectl", "apply", "-f", str(SEED)], env=box.env,
                capture_output=True, text=True, timeout=60)
            assert applied.returncode == 0, applied.stderr
            began = time.monotonic()
            while not _ready(box, "tiny-mla"):
                assert time.monotonic() - began < 120, await cluster.describe([pod.name])
                await asyncio.sleep(0.5)
            reconciled = time.monotonic() - began
            stopped = await cluster.delete_pod(pod.name)
    print(f"operator container ready {started:.1f} s after start, as user {user}, read-only "
          f"root {read_only}; seed Ready {reconciled:.1f} s after kubectl apply; stopped "
          f"{stopped:.1f} s after SIGTERM")
    assert user.split(":")[0] == "65532" and read_only is True
    assert stopped < 10, "the operator did not exit on SIGTERM"
