"""The store as a cluster-wide KV cache (real vLLM, CPU build, real Mooncake): a prefill instance
looks in the store before it computes, loads the longest stored run of its prompt's leading
blocks (whoever stored them), and computes only the rest. Engines run one after another, each
in its own process, as separate instances would:

    prefill A   stores prompt X; then the last page X stored is corrupted in the store
    prefill B   another instance: prompt Y shares X's first 512 tokens (not the corrupted
                page); it loads them and computes the rest; the same prompt with another
                cache_salt loads nothing; prompt Z shares every page X stored
    decode      loads Y's and Z's pages through B's transfer parameters

Decode's greedy tokens for Y must equal a single instance's. Negative control, in the same
run: Z reuses the corrupted page, and its tokens must differ from a single instance's.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from kvhelper.keys import block_key

from .engines import (
    connector_config,
    corrupt_values,
    fingerprint_in,
    loaded_blocks,
    prefill,
    run_engine,
)

PROMPT_TOKENS = 612
SHARED_PREFIX = 512
WHOLE_BLOCKS = (PROMPT_TOKENS - 1) // 32 * 32  # X's full blocks for both block sizes
BLOCK_SIZE = {"gqa": 32, "mla": 16}


def prompts() -> tuple[list[int], list[int], list[int]]:
    """X; Y sharing X's first SHARED_PREFIX tokens; Z sharing all of X's full blocks."""
    rng = random.Random(11)
    x = [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS)]
    y = x[:SHARED_PREFIX] + [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS - SHARED_PREFIX)]
    z = x[:WHOLE_BLOCKS] + [rng.randrange(3, 500) for _ in range(PROMPT_TOKENS - WHOLE_BLOCKS)]
    return x, y, z


def request(kind: str, model: Path, prompt_list: list[Any]) -> dict[str, Any]:
    return {"model": str(model), "block_size": BLOCK_SIZE[kind], "prompts": prompt_list,
            "one_at_a_time": True, "max_model_len": 1024}


def single_instance(kind: str, model: Path, tmp: Path) -> tuple[list[int], list[int]]:
    """One ordinary instance with its own prefix cache, serving X, then Y (over X's cached
    prefix, as prefill B computes it over the loaded one), then Y again over its cached
    blocks (as decode computes it), and Z the same way: the answers to Y and Z."""
    x, y, z = prompts()
    result, _ = run_engine(tmp, "single", {**request(kind, model, [x, y, y, z, z]),
                                           "max_tokens": 8, "prefix_caching": True})
    return list(result["token_ids"][2]), list(result["token_ids"][4])


def run_pipeline(kind: str, model: Path, master: str,
                 tmp: Path) -> tuple[list[list[int]], str, str]:
    """Prefill A stores X, whose last page is then corrupted; prefill B serves Y, Y salted
    and Z; decode loads Y and Z. Decode's tokens for Y and Z, and the logs of B and decode."""
    x, y, z = prompts()
    a_params, a_log = prefill(tmp / "a", request(kind, model, [x]), master)
    # Flip the sign bits of the last page X stored for decode: Z shares it, Y does not.
    corrupt_page(master, fingerprint_in(a_log), a_params[0]["kvhelper_prefix_hash"], kind)
    salted = {"prompt_token_ids": y, "cache_salt": "another-tenant"}
    b_params, b_log = prefill(tmp / "b", request(kind, model, [y, salted, z]), master)
    result, decode_log = run_engine(tmp / "decode", "decode", {
        **request(kind, model, [y, z]), "max_tokens": 8,
        "kv_transfer_config": connector_config("kv_consumer", master),
        "kv_transfer_params": [b_params[0], b_params[2]]})
    return [list(tokens) for tokens in result["token_ids"]], b_log, decode_log


def corrupt_page(master: str, fingerprint: str, block_hash: str, kind: str) -> None:
    corrupt_values(master, [block_key(fingerprint, block_hash,
                                      None if kind == "mla" else (1, 0))])


@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_a_prefill_instance_reuses_a_prefix_another_instance_stored(
        kind, tiny_models, mooncake, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    model = shutil.copytree(tiny_models[kind], tmp_path / f"{kind}-reuse")  # pages of its own
    for folder in ("a", "b", "decode", "single"):
        (tmp_path / folder).mkdir()
    (y_tokens, z_tokens), b_log, decode_log = run_pipeline(kind, model, mooncake, tmp_path)
    # B loaded the shared prefix for Y, nothing for the salted Y (another tenant), and all of
    # X's pages for Z.
    block = BLOCK_SIZE[kind]
    assert loaded_blocks(b_log, "in the step") == [SHARED_PREFIX // block, WHOLE_BLOCKS // block], \
        b_log[-3000:]
    assert loaded_blocks(decode_log) == [(PROMPT_TOKENS - 1) // block] * 2
    y_single, z_single = single_instance(kind, model, tmp_path / "single")
    assert y_tokens == y_single
    assert z_tokens != z_single  # negative control: the reused corrupted page is seen


def test_a_second_turn_finds_its_whole_history_when_decode_saves(
        tiny_models, mooncake, tmp_path, monkeypatch) -> None:
    """Decode with save_decode_cache stores the finished request's blocks, generated tokens
    included; the conversation's next turn, on another prefill instance, loads all of them."""
    monkeypatch.setenv("MC_TCP_BIND_ADDRESS", "127.0.0.1")
    model = shutil.copytree(tiny_models["gqa"], tmp_path / "gqa-turns")
    for folder in ("a", "decode", "b", "decode2", "single"):
        (tmp_path / folder).mkdir()
    x, _, _ = prompts()
    a_params, _ = prefill(tmp_path / "a", request("gqa", model, [x]), mooncake)
    saving = connector_config("kv_consumer", mooncake)
    saving["kv_connector_extra_config"]["save_decode_cache"] = True
    turn, decode_log = run_engine(tmp_path / "decode", "decode", {
        **request("gqa", model, [x]), "max_tokens": 40, "kv_transfer_config": saving,
        "kv_transfer_params": a_params})
    answer = turn["token_ids"][0]
    # 612 + 40 tokens, the last without KV: 20 full blocks, 19 of them the prompt's.
    assert re.search(r"stored 1 KV blocks, 19 already in the store, in [0-9.]+ ms \(after decode\)",
                     decode_log), decode_log[-3000:]
    rng = random.Random(5)
    second = x + answer + [rng.randrange(3, 500) for _ in range(60)]
    b_params, b_log = prefill(tmp_path / "b", request("gqa", model, [second]), mooncake)
    assert loaded_blocks(b_log, "in the step") == [20], b_log[-3000:]  # without decode saving: 19
    result, _ = run_engine(tmp_path / "decode2", "decode", {
        **request("gqa", model, [second]), "max_tokens": 8,
        "kv_transfer_config": connector_config("kv_consumer", mooncake),
        "kv_transfer_params": b_params})
    single, _ = run_engine(tmp_path / "single", "single", {
        **request("gqa", model, [x, second, second]), "max_tokens": 40,
        "prefix_caching": True})
    assert single["token_ids"][0] == answer
    assert result["token_ids"][0] == single["token_ids"][2][:8]
