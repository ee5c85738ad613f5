"""ModelKVSpec from vLLM's own engine config for the tiny models."""

from pathlib import Path

import pytest
from kvhelper.compat import IncompatibleConfig, identity
from kvhelper.connector.settings import ConnectorSettings, SettingsError
from kvhelper.layout import ModelKVSpec
from vllm.engine.arg_utils import EngineArgs


def spec_for(model: Path) -> ModelKVSpec:
    config = EngineArgs(model=str(model), enforce_eager=True, max_model_len=512,
                        block_size=16).create_engine_config()
    return ModelKVSpec.from_vllm_config(config)


def test_spec_from_vllm_config(tiny_models: dict[str, Path]) -> None:
    mla = spec_for(tiny_models["mla"])
    assert (mla.use_mla, mla.head_dim, mla.total_kv_heads, mla.cache_dtype, mla.block_size) == (
        True, 576, 1, "bfloat16", 16)  # latent = kv_lora_rank 512 + rope 64
    gqa = spec_for(tiny_models["gqa"])
    assert (gqa.use_mla, gqa.head_dim, gqa.total_kv_heads, gqa.kv_heads_per_rank) == (
        False, 64, 2, 2)


def test_settings_that_can_never_share_pages_are_refused_at_start(
        tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    config = EngineArgs(model=str(tiny_models["gqa"]), enforce_eager=True, max_model_len=512,
                        block_size=16).create_engine_config()
    assert identity(config)["store_tp_size"] == 1  # K/V pages: one head shard (TP 1)
    assert identity(config, store_tp_size=2)["store_tp_size"] == 2
    with pytest.raises(SettingsError, match="store_tp_size must be a positive integer"):
        ConnectorSettings.parse({"store_tp_size": "2"})
    config.parallel_config.pipeline_parallel_size = 2
    with pytest.raises(IncompatibleConfig, match="pipeline_parallel_size=2"):
        identity(config)
    config.parallel_config.pipeline_parallel_size = 1
    config.cache_config.prefix_caching_hash_algo = "xxhash"
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(IncompatibleConfig, match="set PYTHONHASHSEED"):
        identity(config)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert identity(config)["hash"] == "xxhash"
