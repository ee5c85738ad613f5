"""`disagg-emulator demo`: the operator against the embedded API emulator, driven by kubectl.

Real: the operator (kopf, server-side apply), kubectl, and etcd (its health drives Ready).
Emulated: kube-apiserver (no pods run; workloads report ready as soon as they are applied).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from disagg_operator.handlers import OperatorConfig
from disagg_operator.plan import ClusterAddressing
from disagg_operator.spec import GROUP, PLURAL, VERSION

from disagg_devtools.emulator.sandbox import Sandbox, sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_devtools.waiting import wait_for

Echo = Callable[[str], None]
SERVING_IMAGE = "disagg-operator/serving:0.1.0"


async def run_demo(path: Path, workdir: Path, timeout: float, echo: Echo) -> int:
    for noisy in ("kopf", "aiohttp.access", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    doc = yaml.safe_load(path.read_text())
    meta = doc.get("metadata") or {}
    name, namespace = meta.get("name", ""), meta.get("namespace", "default")
    etcd = await EtcdProcess(workdir / "etcd").start()
    echo(f"• etcd {etcd.endpoint} (a real etcd; stands in for the DisaggServing's etcd)")
    try:
        async with sandbox(workdir / "cluster") as box:
            echo(f"• Kubernetes API emulator at {box.server_url} (no pods run in it)")
            stand_in = {endpoint: etcd.endpoint for endpoint in (
                *ClusterAddressing(namespace).etcd_endpoints(name),
                *((doc.get("spec") or {}).get("etcd") or {}).get("endpoints", []))}
            await box.start_operator(OperatorConfig(
                default_image=SERVING_IMAGE, resync_seconds=5.0, not_ready_resync_seconds=1.0,
                etcd_address_overrides=stand_in))
            echo("• operator running (kopf, cluster-wide)\n")
            if shutil.which("kubectl"):
                return await _with_kubectl(box, path, name, namespace, timeout, echo)
            echo("kubectl not found on PATH: applying through the API directly.\n")
            return await _without_kubectl(box, doc, name, namespace, timeout, echo)
    finally:
        etcd.stop()


async def _kubectl(box: Sandbox, echo: Echo, *args: str) -> int:
    echo("$ kubectl " + " ".join(args))
    result = await asyncio.to_thread(subprocess.run, ["kubectl", *args], env=box.env,
                                     capture_output=True, text=True, timeout=120)
    if result.stdout.strip():
        echo(result.stdout.rstrip())
    if result.stderr.strip():
        echo(result.stderr.rstrip())
    echo("")
    return result.returncode


async def _with_kubectl(box: Sandbox, path: Path, name: str, namespace: str, timeout: float,
                        echo: Echo) -> int:
    if await _kubectl(box, echo, "apply", "-f", str(path)) != 0:
        return 1
    ready = await _kubectl(box, echo, "wait", "--for=condition=Ready", "-n", namespace,
                           f"disaggserving/{name}", f"--timeout={int(timeout)}s")
    await _kubectl(box, echo, "get", "disaggservings", "-n", namespace)
    await _kubectl(box, echo, "get", "deployments,statefulsets,services,configmaps",
                   "-n", namespace, "-l", f"app.kubernetes.io/instance={name}")
    await _kubectl(box, echo, "get", "disaggserving", name, "-n", namespace, "-o",
                   "jsonpath={range .status.conditions[*]}{.type}={.status} ({.reason}): "
                   "{.message}{\"\\n\"}{end}")
    _print_events(box, name, echo)
    return 0 if ready == 0 else 1


async def _without_kubectl(box: Sandbox, doc: dict[str, object], name: str, namespace: str,
                           timeout: float, echo: Echo) -> int:
    url = f"{box.server_url.rstrip('/')}/apis/{GROUP}/{VERSION}/namespaces/{namespace}/{PLURAL}"
    async with aiohttp.ClientSession() as session, session.post(url, json=doc) as response:
        if response.status >= 300:
            echo(f"create failed: {response.status} {await response.text()}")
            return 1

    def status() -> dict[str, Any]:
        for (res, ns, obj_name), obj in box.emulator.objects.items():
            if res.plural == PLURAL and (ns, obj_name) == (namespace, name) and not obj.deleted:
                return dict(obj.raw.get("status") or {})
        return {}

    def ready() -> bool:
        conditions: list[dict[str, Any]] = status().get("conditions") or []
        return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    try:
        await wait_for(ready, timeout, f"{name} to be Ready")
        code = 0
    except TimeoutError as err:
        echo(str(err))
        code = 1
    echo(json.dumps(status(), indent=2))
    _print_events(box, name, echo)
    return code


def _print_events(box: Sandbox, name: str, echo: Echo) -> None:
    events = [obj.raw for (res, _, _), obj in box.emulator.objects.items()
              if res.plural == "events" and not obj.deleted
              and obj.raw.get("involvedObject", {}).get("name") == name]
    echo("Events:")
    for event in events:
        echo(f"  {event.get('type', ''):8} {event.get('reason', ''):14} {event.get('message', '')}")
