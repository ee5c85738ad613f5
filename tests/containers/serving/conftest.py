"""The seed topology rendered by the operator and run as containers (make e2e-containers).

Runs as root inside a network namespace of its own (the Makefile's `unshare -n`): podman's
network, and every pod on it, exist only there."""

from __future__ import annotations

import asyncio
import copy
import os
import subprocess
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
import yaml
from disagg_devtools.containers.cluster import PodmanCluster
from disagg_devtools.containers.kubelet import RunningPod
from disagg_devtools.containers.podman import environment
from disagg_devtools.containers.pods import PodPlan
from disagg_devtools.tiny_models import make_mla
from disagg_operator.association import Owner
from disagg_operator.render import render_spec
from disagg_operator.spec import parse_spec

HERE = Path(__file__).parent
SPEC = HERE.parent / "tiny-mla-1p2d.yaml"
SERVING_IMAGE = "disagg-operator/serving:0.1.0"
IMAGES = (SERVING_IMAGE, "localhost/disagg-base/etcd:3.5")
READY_TIMEOUT = 900.0


@dataclass
class Deployment:
    cluster: PodmanCluster
    name: str
    served: str
    ready_seconds: float
    plain: RunningPod  # one plain vLLM: the decode pod without a connector or registrar

    def url(self, pod: RunningPod) -> str:
        return f"http://{pod.ip}:8000"

    @property
    def proxy(self) -> str:
        return self.url(self.cluster.workload(f"{self.name}-proxy")[0])

    def role(self, role: str) -> list[RunningPod]:
        return self.cluster.workload(f"{self.name}-{role}")


def require_images() -> None:
    missing = [image for image in IMAGES if subprocess.run(
        ["podman", "image", "exists", image], env=environment()).returncode != 0]
    if missing:
        pytest.fail(f"images {missing} are missing: run `make images` first")


def rendered(spec_path: Path = SPEC) -> tuple[str, list[dict[str, Any]]]:
    doc = yaml.safe_load(spec_path.read_text())
    name = doc["metadata"]["name"]
    owner = Owner(name, "default", "uid-e2e")
    return name, render_spec(owner, parse_spec(doc["spec"]), SERVING_IMAGE)


def plain_pod(decode_template: dict[str, Any], name: str) -> PodPlan:
    """The decode pod without disaggregation: no connector, no registrar, no Service."""
    spec = copy.deepcopy(decode_template["spec"])
    spec["containers"] = [c for c in spec["containers"] if c["name"] == "vllm"]
    args = spec["containers"][0]["args"]
    at = args.index("--kv-transfer-config")
    del args[at:at + 2]
    return PodPlan(name, "default", name, {"app": name}, spec)


def put_model(cluster: PodmanCluster) -> None:
    """The tiny MLA model on the claim `tiny-models`, readable as a download job leaves it."""
    model = make_mla(cluster.claim("tiny-models") / "tiny-mla")
    for path in [model, *model.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)


@pytest_asyncio.fixture(scope="package", loop_scope="package")
async def deployment(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Deployment]:
    if os.geteuid() != 0:
        pytest.fail("the container e2e runs as root (podman's rootful networks)")
    require_images()
    folder = tmp_path_factory.mktemp("containers")
    name, objects = rendered()
    async with PodmanCluster("e2e", folder) as cluster:
        put_model(cluster)
        began = time.monotonic()
        await cluster.apply(objects)
        decode = next(o for o in objects if o["metadata"]["name"] == f"{name}-decode")
        plain, = await cluster.start_pods([plain_pod(decode["spec"]["template"], "plain")])
        await cluster.wait_ready(READY_TIMEOUT)
        ready = time.monotonic() - began
        served = decode["spec"]["template"]["spec"]["containers"][0]["args"]
        deployment = Deployment(cluster, name, served[served.index("--served-model-name") + 1],
                                ready, plain)
        await _wait_registered(deployment, deadline=time.monotonic() + 300)
        yield deployment


async def healthy_instances(deployment: Deployment) -> set[str]:
    """The URLs of the instances the proxy routes to now."""
    async with aiohttp.ClientSession() as session, \
            session.get(f"{deployment.proxy}/instances") as response:
        return {i["url"] for i in await response.json() if i["healthy"]}


async def wait_routed(deployment: Deployment, pods: list[RunningPod], deadline: float) -> None:
    """Until the proxy routes to each of `pods` (their registrars joined)."""
    wanted = {deployment.url(p) for p in pods}
    while time.monotonic() < deadline:
        if wanted <= await healthy_instances(deployment):
            return
        await asyncio.sleep(1)
    raise TimeoutError(f"the proxy never routed to {sorted(wanted)}")


async def _wait_registered(deployment: Deployment, deadline: float) -> None:
    await wait_routed(deployment, deployment.role("prefill") + deployment.role("decode"),
                      deadline)
