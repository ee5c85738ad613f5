"""The kvhelper connector inside real vLLM (CPU build): prefill stores, decode loads, and the
decode's greedy tokens equal a single instance's. Engines run one at a time, each in its own
process, against a real mooncake_master; a segment holder keeps the pages in between."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from kvhelper.keys import block_key
from kvhelper.master_process import MooncakeMaster
from kvhelper.store import MooncakeConfig, MooncakeKVStore

from .conftest import in_private_network

HERE = Path(__file__).parent
# Long enough for full blocks at every block size a CPU backend picks (up to 128).
PROMPTS = [("the quick brown fox jumps over the lazy dog and the key value cache holds "
            "attention state for every token in the prompt ") * 9,
           ("prefill computes the prompt and decode generates the answer while pages move "
            "between instances through the store ") * 9]
# A staging buffer of 3 blocks of the tiny GQA model (2 layers x 32 tokens x 512 bytes), so
# that every prompt moves in several chunks.
SMALL_STAGING = {"transfer": "staging", "staging_buffer_bytes": 100_000}
# CPU attention wants multiples of 32 for K/V; for MLA the backend picks (16 without AMX,
# 32 with it).
BLOCK_SIZE = {"gqa": 32, "mla": None}


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
        self.holder.terminate()
        self.holder.wait(10)
        self.master.restart()
        self.holder = self._start_holder()

    def stop(self) -> None:
        self.holder.terminate()
        self.holder.wait(10)
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


@pytest.fixture(scope="module")
def mooncake(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with store_service(tmp_path_factory.mktemp("mooncake")) as service:
        yield service.address


def run_engine(tmp: Path, name: str, request: dict[str, Any]) -> tuple[dict[str, Any], str]:
    request_file, result_file, log = tmp / f"{name}.json", tmp / f"{name}.out", tmp / f"{name}.log"
    request_file.write_text(json.dumps(request))
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "MC_TCP_BIND_ADDRESS": "127.0.0.1",
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # see run_engine.py
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


BaselineOf = Callable[[str], dict[str, Any]]


@pytest.fixture(scope="module")
def baseline(tiny_models, tmp_path_factory) -> BaselineOf:
    """Greedy tokens of one ordinary (non-disaggregated) instance, per model kind, with the
    prompts' full blocks already in its own prefix cache, so that it runs the same arithmetic as
    a decode instance that loaded those blocks: only the rest of the prompt is computed, over
    cached blocks, one request at a time.

    Equality is only exact for the same arithmetic. vLLM's CPU kernels are not batch-invariant,
    and for MLA a cold prefill computes the last prompt token in its prefill path while a
    decode over cached blocks computes it in the decode path. Measured on vLLM 0.32 CPU: the two
    paths write the same latent for that token but a rope part rotated by about its position
    again (the decode path rotates twice), so the next token differs. vLLM's CPU platform also
    turns prefix caching off for MLA; run_engine keeps it on for this baseline.
    """
    results: dict[str, dict[str, Any]] = {}

    def of(kind: str) -> dict[str, Any]:
        if kind not in results:
            results[kind], _ = run_engine(tmp_path_factory.mktemp(f"baseline-{kind}"), "baseline",
                                          {**common(kind, tiny_models), "max_tokens": 8,
                                           "warm_prefix_cache": True})
        return results[kind]

    return of


def common(kind: str, tiny_models: dict[str, Path], model: Path | None = None) -> dict[str, Any]:
    # One request at a time in every run: vLLM's CPU kernels are not batch-invariant.
    return {"model": str(model or tiny_models[kind]), "block_size": BLOCK_SIZE[kind],
            "prompts": PROMPTS, "one_at_a_time": True}


def prefill(tmp: Path, request: dict[str, Any], master: str,
            extra: dict[str, Any] | None = None, role: str = "kv_producer"
            ) -> tuple[list[dict[str, Any]], str]:
    config = connector_config(role, master)
    config["kv_connector_extra_config"].update(extra or {})
    result, log = run_engine(tmp, "prefill", {
        **request, "max_tokens": 1, "kv_transfer_config": config,
        "kv_transfer_params": [{"do_remote_decode": True}] * len(PROMPTS)})
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


class Prefilled:
    """The prompts' KV stored by one prefill engine per model kind (run on first use): its
    kv_transfer_params, and the layout fingerprint that namespaces its pages."""

    def __init__(self, tiny_models: dict[str, Path], master: str,
                 tmp_path_factory: pytest.TempPathFactory) -> None:
        self.tiny_models, self.master, self.tmp_path_factory = tiny_models, master, tmp_path_factory
        self._runs: dict[str, tuple[list[dict[str, Any]], str]] = {}

    def _run(self, kind: str) -> tuple[list[dict[str, Any]], str]:
        if kind not in self._runs:
            params, log = prefill(self.tmp_path_factory.mktemp(f"prefill-{kind}"),
                                  common(kind, self.tiny_models), self.master)
            assert re.search(r"stored [1-9]\d* KV blocks", log), log[-3000:]
            assert all(p["kvhelper_identity"]["mla"] == (kind == "mla") for p in params)
            self._runs[kind] = params, fingerprint_in(log)
        return self._runs[kind]

    def __call__(self, kind: str) -> list[dict[str, Any]]:
        return self._run(kind)[0]

    def fingerprint(self, kind: str) -> str:
        return self._run(kind)[1]


@pytest.fixture(scope="module")
def prefilled(tiny_models, mooncake, tmp_path_factory) -> Prefilled:
    return Prefilled(tiny_models, mooncake, tmp_path_factory)


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


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_decode_loads_prefill_kv_and_matches_a_single_instance(
        kind, tiny_models, mooncake, baseline, prefilled, tmp_path) -> None:
    result, decode_log = decode(tmp_path, common(kind, tiny_models), mooncake, prefilled(kind))
    assert result["token_ids"] == baseline(kind)["token_ids"]
    blocks = loaded_blocks(decode_log)
    assert len(blocks) == len(PROMPTS) and all(blocks), decode_log[-3000:]
    assert "could not be loaded" not in decode_log


def test_corrupted_pages_change_the_output(tiny_models, mooncake, baseline, tmp_path,
                                           monkeypatch) -> None:
    """Negative control for the equality above: the same run with every stored page's values
    negated must not reproduce the baseline, so equality means the KV really came through."""
    # A renamed copy: another fingerprint, so these pages are this test's own.
    model = shutil.copytree(tiny_models["mla"], tmp_path / "mla-copy")
    request = common("mla", tiny_models, model)
    params, prefill_log = prefill(tmp_path, request, mooncake)
    keys = [block_key(fingerprint_in(prefill_log), p["kvhelper_prefix_hash"]) for p in params]
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with store_client(mooncake) as client:
        for key in keys:  # the last block decode loads per prompt: flip every bf16 sign bit
            page = read_value(client, key)
            page.view(torch.int16).bitwise_xor_(-0x8000)
            client.remove(key, force=True)  # our own read just took a lease on it
            client.register(page)
            assert client.put([key], [page.data_ptr()], [page.numel()]).stored == [key]
            client.unregister(page)
            assert torch.equal(read_value(client, key), page)
    # Loaded inside the step this time (load_async false), the other way.
    result, decode_log = decode(tmp_path, request, mooncake, params, load_async=False)
    loaded = loaded_blocks(decode_log, "in the step")
    assert len(loaded) == len(PROMPTS) and all(loaded), "the corrupted pages were not loaded"
    for ours, expected in zip(result["token_ids"], baseline("mla")["token_ids"], strict=True):
        assert ours != expected


def test_incompatible_prefill_is_refused_naming_the_difference(
        tiny_models, mooncake, prefilled, tmp_path) -> None:
    request = {**common("gqa", tiny_models), "block_size": 64}
    result, decode_log = decode(tmp_path, request, mooncake, prefilled("gqa"), reference=True)
    assert "block_size: 32 (prefill) != 64 (decode)" in decode_log
    assert not loaded_blocks(decode_log)
    # Recomputed: exactly what this engine computes for the prompts without any KV transfer.
    assert result["token_ids"] == result["reference_token_ids"]


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_absent_pages_follow_the_load_failure_policy(policy, tiny_models, mooncake,
                                                     tmp_path) -> None:
    # The same weights under another name: another fingerprint, so none of the pages stored
    # by other tests match (keys are namespaced by fingerprint).
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-renamed")
    params = [{"do_remote_prefill": True, "kvhelper_tokens": 64}] * len(PROMPTS)
    # Both ways of loading: asynchronous and inside the step (the default).
    result, decode_log = decode(tmp_path, common("gqa", tiny_models, model), mooncake, params,
                                policy=policy, reference=policy == "recompute",
                                load_async=policy == "recompute")
    assert "could not be loaded" in decode_log
    if policy == "recompute":  # recomputed, never wrong
        assert result["token_ids"] == result["reference_token_ids"]
    else:  # vLLM ends the request with an error instead of generating
        assert result["finish_reasons"] == ["error"] * len(PROMPTS)
        assert result["token_ids"] == [[]] * len(PROMPTS)


def test_master_restart_between_prefill_and_decode_recomputes(tiny_models, tmp_path) -> None:
    request = common("gqa", tiny_models)
    with store_service(tmp_path / "store") as service:
        params, _ = prefill(tmp_path, request, service.address)
        service.restart_master()
        result, decode_log = decode(tmp_path, request, service.address, params, reference=True)
    assert "could not be loaded" in decode_log
    assert result["token_ids"] == result["reference_token_ids"]



def test_gqa_tensor_parallel_ranks_store_and_load_their_own_heads(
        tiny_models, mooncake, tmp_path, monkeypatch) -> None:
    """TP 2: each rank stores the page of its own KV head under its own key, and each decode
    rank loads its own; the output is what the same TP-2 engine computes without transfer."""
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-tp2")  # pages of its own
    request = {**common("gqa", tiny_models, model), "tensor_parallel_size": 2}
    params, prefill_log = prefill(tmp_path, request, mooncake)
    stored = sorted(stored_blocks(prefill_log))  # a line per request and rank
    assert len(stored) == 2 * len(PROMPTS) and stored[::2] == stored[1::2], prefill_log[-3000:]
    fingerprint = fingerprint_in(prefill_log)
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with store_client(mooncake) as client:
        rank0, rank1 = (read_value(client, block_key(fingerprint,
                                                     params[0]["kvhelper_prefix_hash"], shard))
                        for shard in ((2, 0), (2, 1)))
    assert rank0.numel() == rank1.numel() and not torch.equal(rank0, rank1)  # other heads
    result, decode_log = decode(tmp_path, request, mooncake, params, reference=True)
    loaded = loaded_blocks(decode_log)
    assert len(loaded) == 2 * len(PROMPTS) and all(loaded), decode_log[-3000:]
    assert result["token_ids"] == result["reference_token_ids"]


def test_staged_transfers_move_pages_in_chunks(tiny_models, mooncake, tmp_path) -> None:
    """The path device caches take, run on the CPU cache: pages are gathered into a small
    registered host buffer and stored chunk by chunk, then read back and scattered the same
    way; decode's tokens are those it computes without transfer."""
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-staged")  # pages of its own
    request = common("gqa", tiny_models, model)
    params, prefill_log = prefill(tmp_path, request, mooncake, extra=SMALL_STAGING)
    assert "staging buffer (3 blocks at a time)" in prefill_log
    stored = stored_blocks(prefill_log)
    assert len(stored) == len(PROMPTS) and min(stored) > 3, prefill_log[-3000:]  # 2+ chunks
    result, decode_log = decode(tmp_path, request, mooncake, params, reference=True,
                                extra=SMALL_STAGING)
    assert "staging buffer (3 blocks at a time)" in decode_log
    assert loaded_blocks(decode_log) == [tokens // 32 for tokens in
                                         (p["kvhelper_tokens"] for p in params)], \
        decode_log[-3000:]
    assert result["token_ids"] == result["reference_token_ids"]


def test_kv_both_instances_store_and_load(tiny_models, mooncake, tmp_path) -> None:
    """Two kv_both instances: the first stores what it prefills; the second loads those pages
    for the requests that carry prefill's parameters, and its own store of the same blocks
    finds them all there already."""
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-both")  # pages of its own
    request = common("gqa", tiny_models, model)
    params, prefill_log = prefill(tmp_path, request, mooncake, role="kv_both")
    assert all(stored_blocks(prefill_log)), prefill_log[-3000:]
    result, decode_log = decode(tmp_path, request, mooncake, params, reference=True,
                                role="kv_both")
    loaded = loaded_blocks(decode_log)
    assert len(loaded) == len(PROMPTS) and all(loaded), decode_log[-3000:]
    assert re.search(r"stored 0 KV blocks, [1-9]\d* already in the store", decode_log)
    assert result["token_ids"] == result["reference_token_ids"]


def test_gqa_pages_cross_tp_sizes_in_head_shards(tiny_models, mooncake, prefilled, tmp_path,
                                                monkeypatch) -> None:
    """A TP-1 prefill with store_tp_size 2 stores each block as two one-head shards, whose bytes
    are exactly the heads of the page a TP-1 prefill stores whole; a TP-2 decode loads them,
    each rank its own head, and generates what it computes without transfer."""
    request = common("gqa", tiny_models)
    # Through a small staging buffer: the shards are cut from gathered pages, chunk by chunk.
    params, prefill_log = prefill(tmp_path, request, mooncake,
                                  extra={"store_tp_size": 2, **SMALL_STAGING})
    assert "store shards [0, 1] of 2" in prefill_log
    assert "staging buffer (3 blocks at a time)" in prefill_log
    assert all(p["kvhelper_identity"]["store_tp_size"] == 2 for p in params)
    fingerprint = fingerprint_in(prefill_log)
    assert fingerprint == prefilled.fingerprint("gqa")  # the same layout, other shard keys
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    with store_client(mooncake) as client:
        for ours, whole in zip(params, prefilled("gqa"), strict=True):
            prefix_hash = ours["kvhelper_prefix_hash"]
            assert prefix_hash == whole["kvhelper_prefix_hash"]
            # (layers, heads, block, K and V of 64): the CPU cache's packed page, per layer.
            page = read_value(client, block_key(fingerprint, prefix_hash, (1, 0)))
            page = page.view(2, 2, -1)
            for head in (0, 1):
                shard = read_value(client, block_key(fingerprint, prefix_hash, (2, head)))
                assert torch.equal(shard.view(2, -1), page[:, head])
    result, decode_log = decode(tmp_path, {**request, "tensor_parallel_size": 2}, mooncake,
                                params, reference=True)
    assert "store shards [1] of 2" in decode_log  # rank 1 reads the second head's shard
    loaded = loaded_blocks(decode_log)
    assert len(loaded) == 2 * len(PROMPTS) and all(loaded), decode_log[-3000:]
    assert result["token_ids"] == result["reference_token_ids"]


def test_gqa_tp2_prefill_feeds_a_tp1_decode_with_the_same_store_tp_size(
        tiny_models, mooncake, tmp_path) -> None:
    """The other way round: a TP-2 prefill stores one shard per rank; a TP-1 decode with
    store_tp_size 2 reads both into its two-head pages (through a small staging buffer)."""
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-cross")  # pages of its own
    request = common("gqa", tiny_models, model)
    params, _ = prefill(tmp_path, {**request, "tensor_parallel_size": 2}, mooncake)
    result, decode_log = decode(tmp_path, request, mooncake, params, reference=True,
                                extra={"store_tp_size": 2, **SMALL_STAGING})
    assert "store shards [0, 1] of 2" in decode_log
    assert "staging buffer (3 blocks at a time)" in decode_log
    loaded = loaded_blocks(decode_log)
    assert len(loaded) == len(PROMPTS) and all(loaded), decode_log[-3000:]
    assert result["token_ids"] == result["reference_token_ids"]


def test_mla_tensor_parallel_stores_one_page_that_every_rank_loads(
        tiny_models, mooncake, prefilled, tmp_path, monkeypatch) -> None:
    """MLA pages are the same on every rank: a TP-2 prefill stores each once (rank 0), both
    decode ranks load that one page, and it holds what a TP-1 prefill computes."""
    model = shutil.copytree(tiny_models["mla"], tmp_path / "mla-tp2")  # pages of its own
    request = {**common("mla", tiny_models, model), "tensor_parallel_size": 2}
    params, prefill_log = prefill(tmp_path, request, mooncake)
    assert len(stored_blocks(prefill_log)) == len(PROMPTS), prefill_log[-3000:]
    ours, theirs = fingerprint_in(prefill_log), prefilled.fingerprint("mla")  # TP 1's pages
    assert ours != theirs
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    tp1_params = prefilled("mla")
    with store_client(mooncake) as client:
        for tp2_params, tp1 in zip(params, tp1_params, strict=True):
            assert tp2_params["kvhelper_prefix_hash"] == tp1["kvhelper_prefix_hash"]
            tp2_page, tp1_page = (read_value(client, block_key(fp, tp1["kvhelper_prefix_hash"]))
                                  for fp in (ours, theirs))
            # Per layer, one block of 576-wide bf16 latents. Layer 0 is computed from the
            # embeddings alone (replicated on every rank): bit-identical. Layer 1 sees
            # activations summed across ranks in another order: equal up to bf16 rounding
            # (another block's latents would be off by about 100%).
            tp2_layers, tp1_layers = (page.view(torch.bfloat16).view(2, -1, 576).float()
                                      for page in (tp2_page, tp1_page))
            assert torch.equal(tp2_layers[0], tp1_layers[0])
            error = (tp2_layers[1] - tp1_layers[1]).norm() / tp1_layers[1].norm()
            assert error < 0.02, f"layer 1 differs by {error:.1%}"
    result, decode_log = decode(tmp_path, request, mooncake, params)
    loaded = loaded_blocks(decode_log)
    assert len(loaded) == 2 * len(PROMPTS) and all(loaded), decode_log[-3000:]
    baseline, _ = run_engine(tmp_path, "baseline", {**request, "max_tokens": 8,
                                                    "warm_prefix_cache": True})
    assert result["token_ids"] == baseline["token_ids"]
