"""The kvhelper connector inside real vLLM (CPU build): prefill stores, decode loads, and the
decode's greedy tokens equal a single instance's. Engines run one at a time, each in its own
process, against a real mooncake_master; a segment holder keeps the pages in between."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from disagg_operator.etcd_process import free_port

from .test_store import in_private_network

HERE = Path(__file__).parent
# Long enough for full blocks at every block size a CPU backend picks (up to 128).
PROMPTS = [("the quick brown fox jumps over the lazy dog and the key value cache holds "
            "attention state for every token in the prompt ") * 9,
           ("prefill computes the prompt and decode generates the answer while pages move "
            "between instances through the store ") * 9]
# CPU attention wants multiples of 32 for K/V; for MLA the backend picks (16 without AMX,
# 32 with it).
BLOCK_SIZE = {"gqa": 32, "mla": None}


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    work = tmp_path_factory.mktemp("mooncake")
    binary = shutil.which("mooncake_master", path=os.path.dirname(sys.executable))
    assert binary
    port = free_port()
    master = subprocess.Popen([binary, "--rpc_address=127.0.0.1", f"--rpc_port={port}",
                               f"--metrics_port={free_port()}"],
                              stdout=(work / "master.log").open("w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            assert time.monotonic() < deadline, "mooncake_master did not start"
            time.sleep(0.05)
    address = f"127.0.0.1:{port}"
    env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
    holder = subprocess.Popen([sys.executable, str(HERE / "segment_holder.py"), address,
                               str(512 << 20)], stdout=subprocess.PIPE, env=env, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
    yield address
    holder.terminate()
    holder.wait(10)
    master.terminate()
    master.wait(10)


def run_engine(tmp: Path, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], str]:
    request_file, result_file, log = tmp / f"{name}.json", tmp / f"{name}.out", tmp / f"{name}.log"
    request_file.write_text(json.dumps(request))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "HF_HUB_OFFLINE": "1",
           "VLLM_LOGGING_LEVEL": "INFO"}
    with log.open("w") as out:
        code = subprocess.run([sys.executable, str(HERE / "run_engine.py"), str(request_file),
                               str(result_file)], stdout=out, stderr=subprocess.STDOUT,
                              env=env, timeout=600).returncode
    text = log.read_text()
    assert code == 0, text[-4000:]
    return json.loads(result_file.read_text()), text


def connector_config(role: str, master: str) -> dict[str, Any]:
    return {"kv_connector": "MooncakeStoreConnector",
            "kv_connector_module_path": "kvhelper.connector", "kv_role": role,
            "kv_connector_extra_config": {"master_server_address": master,
                                          "local_hostname": "127.0.0.1",
                                          "global_segment_size": 0,
                                          "local_buffer_size": 64 << 20}}


@pytest.fixture(scope="module")
def baseline(tiny_models, tmp_path_factory) -> dict[str, Any]:
    """Greedy tokens of one ordinary (non-disaggregated) instance."""
    result, _ = run_engine(tmp_path_factory.mktemp("baseline"), "baseline",
                           {**common("gqa", tiny_models), "max_tokens": 8})
    return result


def common(kind: str, tiny_models: dict[str, Path]) -> dict[str, Any]:
    return {"model": str(tiny_models[kind]), "block_size": BLOCK_SIZE[kind], "prompts": PROMPTS}


def test_decode_loads_prefill_kv_and_matches_a_single_instance(
        tiny_models, mooncake, baseline, tmp_path) -> None:
    prefill, prefill_log = run_engine(tmp_path, "prefill", {
        **common("gqa", tiny_models), "max_tokens": 1,
        "kv_transfer_config": connector_config("kv_producer", mooncake),
        "kv_transfer_params": [{"do_remote_decode": True}] * len(PROMPTS)})
    assert "stored" in prefill_log
    params = prefill["kv_transfer_params"]
    assert all(p and p["do_remote_prefill"] and p["kvhelper_tokens"] > 0 for p in params)
    decode, decode_log = run_engine(tmp_path, "decode", {
        **common("gqa", tiny_models), "max_tokens": 8,
        "kv_transfer_config": connector_config("kv_consumer", mooncake),
        "kv_transfer_params": params})
    assert decode["token_ids"] == baseline["token_ids"]
    loaded = [line for line in decode_log.splitlines() if "loaded" in line and "KV blocks" in line]
    assert len(loaded) == len(PROMPTS) and all(" loaded 0 " not in line for line in loaded)


def test_absent_pages_are_recomputed_under_the_recompute_policy(
        tiny_models, mooncake, baseline, tmp_path) -> None:
    config = {**connector_config("kv_consumer", mooncake), "kv_load_failure_policy": "recompute"}
    # The same weights under another name: another fingerprint, so none of the pages stored
    # by other tests match (keys are namespaced by fingerprint), yet the tokens must not change.
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-renamed")
    params = [{"do_remote_prefill": True, "kvhelper_tokens": 64}] * len(PROMPTS)
    decode, decode_log = run_engine(tmp_path, "decode", {
        **common("gqa", tiny_models), "model": str(model), "max_tokens": 8,
        "kv_transfer_config": config, "kv_transfer_params": params})
    assert "could not be loaded" in decode_log
    assert decode["token_ids"] == baseline["token_ids"]  # recomputed, never wrong
