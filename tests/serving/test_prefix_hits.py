"""Decode instances that already hold part of a prompt in their own prefix cache (real vLLM,
CPU build, real Mooncake). vLLM asks the connector only for the tokens after the local hit; the
loaded pages must land in the blocks after the locally cached ones, never on them. Every mix is
run one request after another on one decode engine, and its greedy tokens are compared with a
single instance's:

    X          612 tokens, nothing cached locally: every stored block is loaded (the plain
               prefill -> decode path)
    Y          X's first 512 tokens, then others: a partial local hit, the rest loaded
    Z          X's tokens up to one stored block short of X's end: one block loaded
    X again    every stored block cached locally: nothing loaded

Afterwards the same prompts are asked again without transfer parameters: a load written over
cached blocks would have poisoned the decode's prefix cache, and those answers would differ.
The probe connector (checked_connector.py) records each load beside the request's cached
blocks, so the test also checks that no loaded block id is one the request already had.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from .engines import connector_config, loaded_blocks, prefill, run_engine

PROMPT_TOKENS = 612
SHARED_PREFIX = 512  # a multiple of every block size here (16 for MLA, 32 for K/V)
BLOCK_SIZE = {"gqa": 32, "mla": 16}  # vLLM 0.32's CPU MLA backend forces 16


def prompts(block_size: int) -> list[list[int]]:
    rng = random.Random(7)  # token ids of the tiny models' 512-word vocabulary

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 500) for _ in range(n)]

    x = tokens(PROMPT_TOKENS)
    stored = (PROMPT_TOKENS - 1) // block_size * block_size  # what decode may load of X
    y = x[:SHARED_PREFIX] + tokens(PROMPT_TOKENS - SHARED_PREFIX)
    z = x[:stored - block_size] + tokens(PROMPT_TOKENS - stored + block_size)
    return [x, y, z, x]


def request(kind: str, tiny_models: dict[str, Path]) -> dict[str, Any]:
    # One request at a time in every run: vLLM's CPU kernels are not batch-invariant.
    return {"model": str(tiny_models[kind]), "block_size": BLOCK_SIZE[kind],
            "prompts": prompts(BLOCK_SIZE[kind]), "one_at_a_time": True,
            "max_model_len": 1024}


@pytest.fixture(scope="module")
def stored(tiny_models, mooncake, tmp_path_factory) -> dict[str, list[dict[str, Any]]]:
    """Per model kind: the prompts' KV stored by a prefill engine, and its transfer params."""
    runs: dict[str, list[dict[str, Any]]] = {}

    def of(kind: str) -> list[dict[str, Any]]:
        if kind not in runs:
            runs[kind], _ = prefill(tmp_path_factory.mktemp(f"prefill-{kind}"),
                                    request(kind, tiny_models), mooncake)
        return runs[kind]

    return of  # type: ignore[return-value]


@pytest.fixture(scope="module")
def single_instance(tiny_models, tmp_path_factory) -> dict[str, list[list[int]]]:
    """Per model kind: one ordinary instance's greedy tokens with each prompt's full blocks in
    its own prefix cache (the same arithmetic as a decode that holds or loaded them)."""
    runs: dict[str, list[list[int]]] = {}

    def of(kind: str) -> list[list[int]]:
        if kind not in runs:
            # Prefill computed Y and Z over X's blocks it found in the store: so does this
            # instance, over its own cached ones.
            result, _ = run_engine(tmp_path_factory.mktemp(f"single-{kind}"), "single",
                                   {**request(kind, tiny_models), "max_tokens": 8,
                                    "warm_prefix_cache": True, "over_earlier_prompts": True})
            runs[kind] = result["token_ids"]
        return runs[kind]

    return of  # type: ignore[return-value]


# MLA loads inside the step are in test_connector.test_corrupted_pages_change_the_output.
@pytest.mark.parametrize("kind,load_async", [("gqa", True), ("gqa", False), ("mla", True)])
def test_loads_after_local_prefix_hits_land_after_the_cached_blocks(
        kind, load_async, tiny_models, mooncake, stored, single_instance, tmp_path) -> None:
    block_size = BLOCK_SIZE[kind]
    config = {**connector_config("kv_consumer", mooncake),
              "kv_connector_module_path": "checked_connector"}
    config["kv_connector_extra_config"]["load_async"] = load_async
    record = tmp_path / "loads.jsonl"
    record.touch()
    result, log = run_engine(tmp_path, "decode", {
        **request(kind, tiny_models), "max_tokens": 8, "prefix_caching": True,
        "kv_transfer_config": config, "kv_transfer_params": stored(kind), "reference": True},
        env={"KVHELPER_PROBE_RECORD": str(record)})
    expected = single_instance(kind)

    stored_blocks = (PROMPT_TOKENS - 1) // block_size
    # X: all; Y: after the shared prefix; Z: one block; X again: none (no load at all).
    assert loaded_blocks(log, "async" if load_async else "in the step") == [
        stored_blocks, stored_blocks - SHARED_PREFIX // block_size, 1], log[-3000:]
    assert "could not be loaded" not in log
    loads = [load for load in map(json.loads, record.read_text().splitlines())
             if "loaded_block_ids" in load]
    assert [len(load["loaded_block_ids"]) for load in loads] == [
        stored_blocks, stored_blocks - SHARED_PREFIX // block_size, 1]
    for load in loads:
        local, loaded = load["local_hit_block_ids"], load["loaded_block_ids"]
        assert not set(local) & set(loaded), load
        if load_async:  # vLLM hashes these blocks only once they are loaded
            assert not set(load["hashed_block_ids"]) & set(loaded), load
        # Right after the locally cached blocks, in the request's own order.
        assert load["block_ids"][len(local):len(local) + len(loaded)] == loaded, load
    assert result["token_ids"] == expected
    # The decode's own prefix cache was not poisoned: recomputed over it, the same answers.
    assert result["reference_token_ids"] == expected
