"""The negative control of the container run: a rendered pod spec with one mount taken away
stops its container, where the spec as rendered keeps running. (The proxy, alone: it needs no
other pod to start; without etcd it keeps retrying.)"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path
from typing import Any

import pytest
from disagg_devtools.containers.cluster import PodmanCluster
from disagg_devtools.containers.kubelet import RunningPod

from .conftest import put_model, rendered, require_images

STAYS_UP_SECONDS = 40.0  # the proxy imports torch and its tokenizer well within this


def _proxy_pods(break_tmp: bool) -> list[Any]:
    name, objects = rendered()
    objects = copy.deepcopy(objects)
    proxy = next(o for o in objects if o["metadata"]["name"] == f"{name}-proxy")
    if break_tmp:
        container = proxy["spec"]["template"]["spec"]["containers"][0]
        container["volumeMounts"] = [m for m in container["volumeMounts"]
                                     if m["mountPath"] != "/tmp"]
    config = [o for o in objects if o["kind"] == "ConfigMap"]
    return [*config, proxy]


async def _first_exit(pod: RunningPod, seconds: float) -> str | None:
    """The pod's first "exited" event within `seconds`, or None."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        exited = [e for e in pod.events if e.startswith("exited")]
        if exited:
            return exited[0]
        await asyncio.sleep(0.5)
    return None


@pytest.mark.parametrize("break_tmp", [False, True], ids=["as-rendered", "without-tmp"])
async def test_a_read_only_root_without_its_tmp_volume_stops_the_proxy(
        tmp_path: Path, break_tmp: bool) -> None:
    require_images()
    async with PodmanCluster(f"control-{int(break_tmp)}", tmp_path) as cluster:
        put_model(cluster)
        await cluster.apply(_proxy_pods(break_tmp))
        pod, = cluster.pods.values()
        exited = await _first_exit(pod, STAYS_UP_SECONDS)
        logs = await pod.logs("proxy", 30)
    if break_tmp:
        assert exited is not None, "the proxy ran without a writable /tmp"
        assert "No usable temporary directory" in logs, logs
    else:
        assert exited is None, (exited, logs)
