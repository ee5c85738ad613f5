"""Helpers for tests that run real vLLM engines (CPU build) with the kvhelper connector, one
engine per process (`run_engine.py`, forked from `engine_forker.py` after vLLM's imports),
against a real mooncake_master."""

from __future__ import annotations

import atexit
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from disagg_devtools.master_process import MooncakeMaster
from disagg_devtools.processes import stop_process
from kvhelper.store import MooncakeConfig, MooncakeKVStore

from .conftest import in_private_network

HERE = Path(__file__).parent

class StoreService:
    """A real mooncake_master plus a segment holder: the memory the pages live in between the
    prefill and the decode engine (each engine runs, and exits, on its own)."""

    def __init__(self, work: Path) -> None:
        self.work = work
        self.master = MooncakeMaster(work / "master.log").start()
        self.holder = self._start_holder()

    @property
    def address(self) -> str:
        return self.master.address

    def _start_holder(self) -> subprocess.Popen[str]:
        env = {**os.environ, "MC_TCP_BIND_ADDRESS": "127.0.0.1"}
        holder = subprocess.Popen([sys.executable, str(HERE / "segment_holder.py"),
                                   self.address, str(512 << 20)], stdout=subprocess.PIPE,
                                  env=env, text=True)
        assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
        return holder

    def restart_master(self) -> None:
        """Everything the master knew is gone; the holder mounts a fresh segment."""
        stop_process(self.holder)
        self.master.restart()
        self.holder = self._start_holder()

    def stop(self) -> None:
        stop_process(self.holder)
        self.master.stop()


@contextmanager
def store_service(work: Path) -> Iterator[StoreService]:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    service = StoreService(work)
    try:
        yield service
    finally:
        service.stop()


class EngineForker:
    """One engine_forker.py process for the test session: each run_engine job is a process
    forked from it after vLLM's imports, which are most of a tiny engine's start-up."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None

    def run(self, argv: list[str], log: Path, env: dict[str, str], timeout: float) -> int:
        if self.process is None or self.process.poll() is not None:
            self.process = subprocess.Popen(
                [sys.executable, str(HERE / "engine_forker.py")], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env={**os.environ, **FORKER_ENV})
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"argv": argv, "log": str(log), "env": env,
                                             "timeout": timeout}) + "\n")
        self.process.stdin.flush()
        reply = self.process.stdout.readline()
        if not reply:
            raise RuntimeError(f"engine_forker.py exited ({self.process.wait()}); "
                               f"the job's log: {log}")
        code: int = json.loads(reply)["code"]
        return code

    def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)
            self.process = None


# Read by vLLM when it is imported, so the same for every job the forker runs.
FORKER_ENV = {"VLLM_LOGGING_LEVEL": "INFO", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
FORKER = EngineForker()
atexit.register(FORKER.stop)


def run_engine(tmp: Path, name: str, request: dict[str, Any],
               env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run one engine on `request` (see run_engine.py) in a process of its own; its result and
    its log. Tensor-parallel engines start their workers as `python run_engine.py` does."""
    request_file, result_file, log = tmp / f"{name}.json", tmp / f"{name}.out", tmp / f"{name}.log"
    request_file.write_text(json.dumps(request))
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                **FORKER_ENV,  # VLLM_ENABLE_V1_MULTIPROCESSING=0: see run_engine.py
                "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "HF_HUB_OFFLINE": "1",
                # The test probe connector (checked_connector.py) is importable from here.
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                            os.environ.get("PYTHONPATH")])),
                **(env or {})}
    argv = [str(request_file), str(result_file)]
    code = FORKER.run(argv, log, full_env, timeout=600)
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


def prefill(tmp: Path, request: dict[str, Any], master: str,
            extra: dict[str, Any] | None = None, role: str = "kv_producer"
            ) -> tuple[list[dict[str, Any]], str]:
    config = connector_config(role, master)
    config["kv_connector_extra_config"].update(extra or {})
    result, log = run_engine(tmp, "prefill", {
        **request, "max_tokens": 1, "kv_transfer_config": config,
        "kv_transfer_params": [{"do_remote_decode": True}] * len(request["prompts"])})
    params = result["kv_transfer_params"]
    assert all(p and p["do_remote_prefill"] and p["kvhelper_tokens"] > 0 for p in params), params
    return params, log


def decode(tmp: Path, request: dict[str, Any], master: str, params: list[dict[str, Any]],
           policy: str = "recompute", reference: bool = False,
           load_async: bool = True, extra: dict[str, Any] | None = None,
           role: str = "kv_consumer") -> tuple[dict[str, Any], str]:
    """The decode engine's result; with `reference`, also the same prompts recomputed on it.
    Loads are asynchronous unless `load_async` is False."""
    config = {**connector_config(role, master), "kv_load_failure_policy": policy}
    config["kv_connector_extra_config"].update({"load_async": load_async, **(extra or {})})
    return run_engine(tmp, "decode", {**request, "max_tokens": 8, "kv_transfer_config": config,
                                      "kv_transfer_params": params, "reference": reference})


def fingerprint_in(log: str) -> str:
    """The layout fingerprint a connector logged when it started."""
    found = re.search(r"fingerprint ([0-9a-f]{16})", log)
    assert found, log[-3000:]
    return found[1]


def loaded_blocks(log: str, mode: str = "async") -> list[int]:
    """Blocks loaded per request, from the connector's log lines (async, or in the step)."""
    return [int(m) for m in re.findall(rf"loaded (\d+) KV blocks .* \({mode}\)", log)]


def stored_blocks(log: str) -> list[int]:
    """Blocks stored per request and rank, from the connector's log lines."""
    return [int(m) for m in re.findall(r"stored (\d+) KV blocks", log)]


def read_value(client: MooncakeKVStore, key: str) -> torch.Tensor:
    value = torch.empty(client.size(key), dtype=torch.uint8)
    client.register(value)
    assert not client.get([key], [value.data_ptr()], [value.numel()]), key
    client.unregister(value)
    return value


@contextmanager
def store_client(master: str, metadata_server: str = "P2PHANDSHAKE"
                 ) -> Iterator[MooncakeKVStore]:
    client = MooncakeKVStore(MooncakeConfig(master_server_address=master,
                                            metadata_server=metadata_server,
                                            global_segment_size=0, local_buffer_size=64 << 20,
                                            local_hostname="127.0.0.1"))
    try:
        yield client
    finally:
        client.close()


def corrupt_values(master: str, keys: list[str], metadata_server: str = "P2PHANDSHAKE") -> None:
    """Flip every bf16 sign bit of these stored values, in place in the store (in a float32
    value: the sign of every other half)."""
    with store_client(master, metadata_server) as client:
        for key in keys:
            page = read_value(client, key)
            page.view(torch.int16).bitwise_xor_(-0x8000)
            client.remove(key, force=True)  # our own read just took a lease on it
            client.register(page)
            assert client.put([key], [page.data_ptr()], [page.numel()]).stored == [key]
            client.unregister(page)
            assert torch.equal(read_value(client, key), page)
