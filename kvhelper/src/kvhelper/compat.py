"""Whether a prefill instance's KV can be loaded by this decode instance, decided before any
page is read, with a message that names what differs.

Prefill sends its *identity* (what the config says about the cache, plus how prompts are
hashed) and the hash of the last stored block in `kv_transfer_params`. Block hashes are chained,
so one hash covers every token of the stored prefix: if decode hashes the same prompt to another
value (another tokenizer, hash algorithm or hash seed), no page key would match, and we say why
instead of silently recomputing.
"""

from __future__ import annotations

import os
from typing import Any

from kvhelper.layout import ModelKVSpec
from kvhelper.tp import TPMismatchError, store_sharding

# Hash algorithms whose seed is random per process unless PYTHONHASHSEED is set (vLLM's rule).
NON_CRYPTO_HASHES = frozenset({"xxhash", "xxhash_cbor"})


class IncompatibleConfig(ValueError):
    """Settings under which prefill and decode instances can never share pages."""


def identity(vllm_config: Any, store_tp_size: int | None = None) -> dict[str, Any]:
    """Everything a prefill and a decode instance must agree on, from the config alone
    (`store_tp_size`: the connector's setting of that name, see `kvhelper.tp`)."""
    spec = ModelKVSpec.from_vllm_config(vllm_config)
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if algo in NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
        raise IncompatibleConfig(
            f"prefix_caching_hash_algo={algo} seeds block hashes randomly in every process, so "
            "no two instances would ever share a page: set PYTHONHASHSEED to the same value on "
            "every prefill and decode instance, or use sha256 (the default)")
    stages = int(vllm_config.parallel_config.pipeline_parallel_size)
    if stages > 1:
        raise IncompatibleConfig(
            f"pipeline_parallel_size={stages}: the kvhelper connector keys a page by block and "
            "TP rank, and each pipeline stage holds other layers, so stages would overwrite "
            "each other's pages; use tensor parallelism (pipeline stages are not supported yet)")
    found: dict[str, Any] = {
        "model": spec.model, "mla": spec.use_mla, "cache_dtype": spec.cache_dtype,
        "block_size": spec.block_size, "head_dim": spec.head_dim,
        "kv_heads": spec.total_kv_heads, "hash": algo,
    }
    if not spec.use_mla:
        # K/V pages are stored in head shards; instances must agree on how many (kvhelper.tp).
        try:  # every rank of an instance holds as many heads as rank 0
            sharding = store_sharding(spec.total_kv_heads, spec.tp_size, 0, store_tp_size)
        except TPMismatchError as err:
            raise IncompatibleConfig(f"kv_connector_extra_config: {err}") from None
        found["store_tp_size"] = sharding.shards
    return found


def differences(prefill: dict[str, Any], decode: dict[str, Any]) -> list[str]:
    """`name: prefill value != decode value` for every setting that differs."""
    found = [f"{name}: {prefill.get(name)!r} (prefill) != {decode.get(name)!r} (decode)"
             for name in sorted(set(prefill) | set(decode))
             if prefill.get(name) != decode.get(name)]
    if prefill.get("store_tp_size") != decode.get("store_tp_size"):
        found.append("K/V pages are stored in store_tp_size head shards, by default the TP "
                     "size: set kv_connector_extra_config.store_tp_size to the same multiple "
                     "of both TP sizes on prefill and decode")
    return found
