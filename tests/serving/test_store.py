"""Mooncake settings, and page I/O through a real mooncake_master and Mooncake store.

Mooncake's listeners bind every interface, so these tests refuse to start it outside a network
namespace of their own: `make test` runs this suite under `unshare -n` with only loopback up.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from disagg_devtools.processes import free_port
from kvhelper.store import ConfigError, MooncakeConfig, MooncakeKVStore, StoreError

from .conftest import in_private_network


def test_config_from_file_and_extra_config(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "m:50051", "protocol": "tcp",
                                "global_segment_size": 1024, "unrelated": 1}))
    config = MooncakeConfig.load({"mooncake_config_path": str(path), "local_buffer_size": 512},
                                 environ={"POD_IP": "10.1.2.3"})
    assert (config.master_server_address, config.global_segment_size,
            config.local_buffer_size) == ("m:50051", 1024, 512)
    from_env = MooncakeConfig.load({}, environ={"MOONCAKE_CONFIG_PATH": str(path)})
    assert from_env.master_server_address == "m:50051"
    # Masters in HA mode: found through etcd (one or several endpoints).
    ha = MooncakeConfig.load({"master_server_address": "etcd://e1:2379;e2:2379"}, environ={})
    assert ha.master_server_address == "etcd://e1:2379;e2:2379"


@pytest.mark.parametrize(("extra", "message"), [
    ({"mooncake_config_path": "/nope.json"}, "mooncake_config_path points to /nope.json"),
    ({"master_server_address": "x:1", "protocol": "rdma"}, "rdma needs device_name"),
    ({"master_server_address": "x"}, "must be host:port"),
    ({"master_server_address": "etcd://a:2379;b"}, "or etcd://host:port"),
    ({"master_server_address": "x:1", "global_segment_size": "1Gi"}, "number of bytes >= 0"),
    ({}, "master_server_address is not set"),
])
def test_config_errors_name_the_setting(extra, message) -> None:
    with pytest.raises(ConfigError, match=message):
        MooncakeConfig.load(extra, environ={})


def test_contradictory_settings_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({"master_server_address": "m:1", "protocol": "tcp"}))
    with pytest.raises(ConfigError, match="protocol is 'rdma' in kv_connector_extra_config"):
        MooncakeConfig.load({"mooncake_config_path": str(path), "protocol": "rdma",
                             "device_name": "mlx5_0"}, environ={})


def test_pages_round_trip_zero_copy_and_existing_keys_are_skipped(store) -> None:
    page = 18432  # one MLA page: 16 tokens x 576 x bf16
    source = (torch.arange(8 * page) % 251).to(torch.uint8)
    target = torch.zeros_like(source)
    store.register(source)
    store.register(target)
    keys = [f"test/fp/{i}" for i in range(8)]
    pointers = [source.data_ptr() + i * page for i in range(8)]
    first = store.put(keys[:5], pointers[:5], [page] * 5)
    assert first.stored == keys[:5] and first.skipped == [] and first.failed == {}
    second = store.put(keys, pointers, [page] * 8)  # a shared prefix: 5 pages already there
    assert second.skipped == keys[:5] and second.stored == keys[5:]
    assert store.exists(keys + ["test/fp/absent"]) == [True] * 8 + [False]
    failed = store.get(keys, [target.data_ptr() + i * page for i in range(8)], [page] * 8)
    assert failed == {} and torch.equal(source, target)


def test_missing_and_short_reads_are_reported_per_key(store) -> None:
    buffer = torch.zeros(4096, dtype=torch.uint8)
    store.register(buffer)
    store.put(["small"], [buffer.data_ptr()], [1024])
    failed = store.get(["absent", "small"], [buffer.data_ptr(), buffer.data_ptr() + 2048],
                       [1024, 2048])
    assert failed == {"absent": -704, "small": -600}


def test_unreachable_master_is_a_clear_error(monkeypatch) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with pytest.raises(StoreError, match="connecting to the Mooncake master"):
        MooncakeKVStore(MooncakeConfig(master_server_address=f"127.0.0.1:{free_port()}",
                                       global_segment_size=16 << 20,
                                       local_buffer_size=16 << 20,
                                       local_hostname="127.0.0.1"))


def test_a_hung_master_costs_a_lookup_its_timeout_not_the_scheduler(tmp_path: Path,
                                                                    monkeypatch) -> None:
    """A master that stops answering (SIGSTOP: alive, connected, silent) must not hold the
    vLLM scheduler that asks it: the lookup gives up after its timeout, later lookups pause
    instead of queueing behind the stuck one, and once the master answers again so do they."""
    import os
    import signal
    import time

    from disagg_devtools.master_process import MooncakeMaster
    from kvhelper.stored_prefix import KeySpace, StoredPrefixLookup

    from .conftest import in_private_network

    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with MooncakeMaster(tmp_path / "master.log", extra_args=["--client_ttl=30"]) as master:
        config = MooncakeConfig(master_server_address=master.address, global_segment_size=0,
                                local_buffer_size=16 << 20, local_hostname="127.0.0.1")
        lookup = StoredPrefixLookup(config, timeout=0.5, pause_after_failure=2.0)
        space = KeySpace("fingerprint", None)
        assert lookup.stored_blocks(space, ["aa", "bb"]) == 0  # connected, nothing stored
        assert master.process is not None
        os.kill(master.process.pid, signal.SIGSTOP)
        try:
            # Keys not asked before: Mooncake's client caches recent answers, and once (in a
            # CI run) it answered fresh keys too while the master was stopped. Every lookup
            # must end within its timeout either way, and one that reaches the master gives up.
            for attempt in range(5):
                started = time.monotonic()
                found = lookup.stored_blocks(space, [f"cc{attempt}", f"dd{attempt}"])
                waited = time.monotonic() - started
                assert waited < 1.5, waited
                if found is None:
                    break  # gave up
                assert found == 0
            else:
                pytest.fail("no lookup reached the stopped master")
            started = time.monotonic()
            assert lookup.stored_blocks(space, ["ee"]) == 0  # paused: no second wait
            assert time.monotonic() - started < 0.1
        finally:
            os.kill(master.process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while lookup.stored_blocks(space, ["aa"]) != 0 or lookup.paused:
            assert time.monotonic() < deadline, "lookups did not come back"
            time.sleep(0.2)
        lookup.close()


def test_concurrent_lookups_each_get_an_answer() -> None:
    """The proxy looks up several requests' prompts at once: a lookup that finds another still
    waiting on the store must wait its own turn on a worker of its own, not fail (with one
    worker it failed, and its request took the fallback route)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from kvhelper.stored_prefix import KeySpace, StoredPrefixLookup

    entered, gate = threading.Semaphore(0), threading.Event()

    class SlowStore:  # a store that answers once the test lets it
        def exists(self, keys: list[str], strict: bool = False) -> list[bool]:
            entered.release()
            assert gate.wait(10)
            return [True] * len(keys)

        def close(self) -> None:
            pass

    config = MooncakeConfig(master_server_address="127.0.0.1:1", global_segment_size=0,
                            local_buffer_size=1 << 20, local_hostname="127.0.0.1")
    lookup = StoredPrefixLookup(config, connect=lambda _: SlowStore(),  # type: ignore[arg-type,return-value]
                                workers=2, timeout=10)
    space = KeySpace("fingerprint", None)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(lookup.stored_blocks, space, ["aa", "bb"])
        assert entered.acquire(timeout=10)
        second = pool.submit(lookup.stored_blocks, space, ["cc"])
        both_waiting = entered.acquire(timeout=5)
        gate.set()
        assert (first.result(), second.result(), both_waiting) == (2, 1, True)
    lookup.close()
