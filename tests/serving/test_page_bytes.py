"""The bytes decode loads are the bytes prefill computed, block by block: real vLLM engines with
the kvhelper connector (a probe records a digest of every block's bytes, all layers, the rope
columns of MLA's latent included), prompts of random lengths whose last full block ends at or
short of the prompt's end. MLA runs vLLM's CPU MLA backend, which forces 16-token blocks; GQA's
CPU attention takes 32. (The answers those bytes give are the exactness harness's business:
test_exactness.py.)"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from .engines import connector_config, run_engine

BLOCK = {"mla": 16, "gqa": 32}


@pytest.mark.parametrize("kind", ["mla", "gqa"])
def test_loaded_blocks_hold_the_bytes_prefill_computed(kind, tiny_models, mooncake,
                                                       tmp_path: Path) -> None:
    block = BLOCK[kind]
    rng = random.Random(7)
    # A prompt of whole blocks plus one token, one a token short of whole blocks, one between.
    lengths = [4 * block + 1, 5 * block - 1, 3 * block + block // 2]
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in lengths]
    base = {"model": str(tiny_models[kind]), "block_size": block, "prompts": prompts,
            "one_at_a_time": True, "max_model_len": 1024,
            "engine_args": {"dtype": "float32"}}

    def config(role: str) -> dict[str, object]:
        return {**connector_config(role, mooncake), "kv_connector_module_path": "checked_connector"}

    for folder in ("p", "d"):
        (tmp_path / folder).mkdir()
    record = tmp_path / "digests.jsonl"
    env = {"KVHELPER_PROBE_DIGESTS": "1", "KVHELPER_PROBE_RECORD": str(record)}
    prefilled, _ = run_engine(tmp_path / "p", "prefill", {
        **base, "max_tokens": 1, "kv_transfer_config": config("kv_producer"),
        "kv_transfer_params": [{"do_remote_decode": True}] * len(prompts)}, env)
    run_engine(tmp_path / "d", "decode", {
        **base, "max_tokens": 2, "kv_transfer_config": config("kv_consumer"),
        "kv_transfer_params": prefilled["kv_transfer_params"]}, env)

    lines = [json.loads(line) for line in record.read_text().splitlines()]
    saved = {h: d for line in lines for h, d in line.get("saved", [])}
    loads = [line["loaded"] for line in lines if "loaded" in line]
    assert [len(load) for load in loads] == [(n - 1) // block for n in lengths], loads
    differing = [(i, j) for i, load in enumerate(loads) for j, (h, d) in enumerate(load)
                 if saved.get(h) != d]
    print(f"{kind}: {sum(map(len, loads))} blocks loaded, {len(differing)} differ from what "
          "prefill computed")
    assert not differing, differing
