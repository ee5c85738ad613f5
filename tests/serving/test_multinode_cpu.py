"""A multi-node instance for real: the command lines the operator renders for a prefill instance
of `nodesPerInstance: 2` (tiny MLA model, TP 2; `vllm serve --nnodes 2 --node-rank
$(LWS_WORKER_INDEX) --master-addr $(LWS_LEADER_ADDRESS)`, `--headless` on the worker), run as
two "nodes": this test's network namespace and a second one, joined by a veth pair. The prefill
instance stores its pages in a real Mooncake store; a one-node decode instance loads them; the
request goes through the proxy. Its greedy tokens must equal those of the same deployment with
the prefill instance's two ranks on one node (two ranks add partial sums in either order alike,
so the split changes no bit), and decode must have loaded the prompt's pages."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from disagg_devtools.master_process import MooncakeMaster
from disagg_devtools.processes import free_port
from disagg_operator.plan import VLLM_PORT

from .conftest import in_private_network
from .rendered import HostAddressing, Node, complete, cpu_environment, local_command, tiny_mla_plan

NODE0, NODE1 = "10.77.0.1", "10.77.0.2"
VETH = "mnveth"  # both ends: each node sees its link under one name, as pods see eth0
PROMPTS = [" ".join(f"turn {i} of a conversation split over two nodes" for _ in range(6))
           for i in range(3)]
MAX_TOKENS = 8


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


def run_deployment(model: Path, folder: Path, nodes: int,
                   node1: list[str] | None) -> tuple[list[list[int]], str]:
    """Start master, prefill (its ranks on `nodes` nodes), decode and proxy; send PROMPTS one at
    a time through the proxy; return their tokens and decode's log."""
    folder.mkdir(parents=True)
    master = MooncakeMaster(folder / "master.log", extra_args=["--rpc_address=0.0.0.0"]).start()
    # Gloo's sockets bind this interface (GLOO_SOCKET_IFNAME, rendered), not loopback.
    plan = tiny_mla_plan(model, HostAddressing(NODE0, master.port),
                         {"tensorParallelSize": 2, "nodesPerInstance": nodes}, {},
                         {"socketInterface": VETH})
    (folder / "mooncake.json").write_text(plan.config_files["mooncake.json"])
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
            # One core per rank in both runs (the same thread count, so the same sums);
            # vLLM's own binding wants a NUMA node per local rank, and this machine has one.
            cores = "0|1" if prefill.worker is None else str(index)
            argv, env = local_command(process, host, {
                **cpu_environment(), "VLLM_CPU_OMP_THREADS_BIND": cores,
                "LWS_WORKER_INDEX": str(index), "LWS_LEADER_ADDRESS": NODE0}, folder)
            node.start(f"prefill-rank{index}", [*prefix, *argv], env)
        decode_argv, decode_env = local_command(decode.main, NODE0, cpu_environment(), folder)
        decode_argv[decode_argv.index("--port") + 1] = str(VLLM_PORT + 1)
        node.start("decode", decode_argv, decode_env)
        proxy_port = free_port()
        node.start("proxy", [sys.executable, "-m", "kvhelper.proxy", "--host", NODE0, "--port",
                             str(proxy_port), "--prefill", f"http://{NODE0}:{VLLM_PORT}",
                             "--decode", f"http://{NODE0}:{VLLM_PORT + 1}"], cpu_environment())
        for url in (f"http://{NODE0}:{VLLM_PORT}/health",
                    f"http://{NODE0}:{VLLM_PORT + 1}/health",
                    f"http://{NODE0}:{proxy_port}/health"):
            node.wait_http(url, 600)
        outputs = [complete(f"http://{NODE0}:{proxy_port}", "tiny-mla", prompt, MAX_TOKENS)
                   for prompt in PROMPTS]
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
