"""Helpers for tests that run real vLLM engines (CPU build) with the kvhelper connector, one
engine per process (`run_engine.py`), against a real mooncake_master."""

from __future__ import annotations

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


def run_engine(tmp: Path, name: str, request: dict[str, Any],
               env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    """Run one engine on `request` (see run_engine.py); its result and its log."""
    request_file, result_file, log = tmp / f"{name}.json", tmp / f"{name}.out", tmp / f"{name}.log"
    request_file.write_text(json.dumps(request))
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1",
                "MC_TCP_BIND_ADDRESS": "127.0.0.1",
                "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # see run_engine.py
                "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"), "HF_HUB_OFFLINE": "1",
                "VLLM_LOGGING_LEVEL": "INFO",
                # The test probe connector (checked_connector.py) is importable from here.
                "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE),
                                                            os.environ.get("PYTHONPATH")])),
                **(env or {})}
    with log.open("w") as out:
        code = subprocess.run([sys.executable, str(HERE / "run_engine.py"), str(request_file),
                               str(result_file)], stdout=out, stderr=subprocess.STDOUT,
                              env=full_env, timeout=600).returncode
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
def store_client(master: str) -> Iterator[MooncakeKVStore]:
    client = MooncakeKVStore(MooncakeConfig(master_server_address=master,
                                            global_segment_size=0, local_buffer_size=64 << 20,
                                            local_hostname="127.0.0.1"))
    try:
        yield client
    finally:
        client.close()


def corrupt_values(master: str, keys: list[str]) -> None:
    """Flip every bf16 sign bit of these stored values, in place in the store."""
    with store_client(master) as client:
        for key in keys:
            page = read_value(client, key)
            page.view(torch.int16).bitwise_xor_(-0x8000)
            client.remove(key, force=True)  # our own read just took a lease on it
            client.register(page)
            assert client.put([key], [page.data_ptr()], [page.numel()]).stored == [key]
            client.unregister(page)
            assert torch.equal(read_value(client, key), page)
