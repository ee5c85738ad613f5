"""The kvhelper connector inside real vLLM (CPU build): prefill stores, decode loads, and the
decode's greedy tokens equal a single instance's. Engines run one at a time, each in its own
process, against a real mooncake_master; a segment holder keeps the pages in between."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from kvhelper.keys import block_key

from .engines import (
    corrupt_values,
    decode,
    fingerprint_in,
    loaded_blocks,
    prefill,
    read_value,
    run_engine,
    store_client,
    store_service,
    stored_blocks,
)

# Long enough for full blocks at every block size a CPU backend picks (up to 128).
PROMPTS = [("the quick brown fox jumps over the lazy dog and the key value cache holds "
            "attention state for every token in the prompt ") * 9,
           ("prefill computes the prompt and decode generates the answer while pages move "
            "between instances through the store ") * 9]
# A staging buffer of 3 blocks of the tiny GQA model (2 layers x 32 tokens x 512 bytes), so
# that every prompt moves in several chunks.
SMALL_STAGING = {"transfer": "staging", "staging_buffer_bytes": 100_000}
# CPU attention wants multiples of 32 for K/V; vLLM 0.32's CPU MLA backend forces 16.
BLOCK_SIZE = {"gqa": 32, "mla": None}


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


def test_corrupted_pages_change_the_output(tiny_models, mooncake, baseline, tmp_path,
                                           monkeypatch) -> None:
    """Negative control for the equality tests (test_prefix_hits.py: decode's tokens equal a
    single instance's): with the last loaded page of each prompt negated in the store, decode
    must not reproduce the single instance, so equality means the KV really came through."""
    # A renamed copy: another fingerprint, so these pages are this test's own.
    model = shutil.copytree(tiny_models["mla"], tmp_path / "mla-copy")
    request = common("mla", tiny_models, model)
    params, prefill_log = prefill(tmp_path, request, mooncake)
    keys = [block_key(fingerprint_in(prefill_log), p["kvhelper_prefix_hash"]) for p in params]
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    corrupt_values(mooncake, keys)  # the last block decode loads, per prompt
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
    # Without store lookups, so that the reference run (no transfer parameters) recomputes
    # instead of finding the prompts in the store (test_store_reuse covers lookups).
    result, decode_log = decode(tmp_path, request, mooncake, params, reference=True,
                                role="kv_both", extra={"store_lookup": False})
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
