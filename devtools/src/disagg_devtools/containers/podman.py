"""The podman command line, with the repo's settings (docker/podman/containers.conf)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[4]
CONTAINERS_CONF = REPO / "docker" / "podman" / "containers.conf"


class PodmanError(RuntimeError):
    pass


def environment() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF",
                                                            str(CONTAINERS_CONF))}


async def podman(*args: str, check: bool = True, timeout: float = 120.0,
                 stdin: bytes | None = None) -> str:
    process = await asyncio.create_subprocess_exec(
        "podman", *args, env=environment(), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(process.communicate(stdin), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise PodmanError(f"podman {' '.join(args[:3])}: no answer in {timeout:.0f} s") from None
    if check and process.returncode != 0:
        raise PodmanError(f"podman {' '.join(args)}: {err.decode(errors='replace')[-2000:]}")
    return out.decode(errors="replace")


async def exec_in(container: str, command: list[str], timeout: float) -> int:
    """Runs a command in a running container; its exit status (124 when past timeout)."""
    process = await asyncio.create_subprocess_exec(
        "podman", "exec", container, *command, env=environment(),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        return await asyncio.wait_for(process.wait(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        return 124


async def container_states(prefix: str) -> dict[str, dict[str, Any]]:
    """name -> {"running": bool, "exit_code": int} for every container named prefix*."""
    listed = json.loads(await podman("ps", "--all", "--format", "json",
                                     "--filter", f"name=^{prefix}") or "[]")
    return {c["Names"][0]: {"running": c["State"] == "running", "exit_code": c.get("ExitCode", 0),
                            "state": c["State"]}
            for c in listed if c.get("Names")}


async def pod_ip(pod: str, network: str) -> str:
    infra = (await podman("pod", "inspect", pod, "--format", "{{.InfraContainerID}}")).strip()
    ip = (await podman("inspect", infra, "--format",
                       f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}')).strip()
    if not ip:
        raise PodmanError(f"pod {pod} has no address on network {network}")
    return ip


async def container_logs(container: str, tail: int | None = None) -> str:
    """The container's output, stdout and stderr interleaved as written."""
    process = await asyncio.create_subprocess_exec(
        "podman", "logs", *(("--tail", str(tail)) if tail else ()), container,
        env=environment(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await process.communicate()
    return out.decode(errors="replace")
