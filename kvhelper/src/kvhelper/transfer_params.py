"""The `kv_transfer_params` that pass between prefill, the proxy and decode: written by the
connector's scheduler side, read by decode's and by the proxy. Free of vLLM, so that the proxy
can read them without loading it."""

from __future__ import annotations

from typing import Any

# From prefill (or the proxy) to decode:
TOKENS_KEY = "kvhelper_tokens"  # how many prompt tokens decode can load (whole blocks)
IDENTITY_KEY = "kvhelper_identity"  # kvhelper.compat.identity() of the prefill instance
PREFIX_HASH_KEY = "kvhelper_prefix_hash"  # hex block hash of the last block decode can load
# Prefill answered before its store ended (asynchronous saves): decode waits for the pages.
STORING_KEY = "kvhelper_storing"
# How prefill's store keys are made (kvhelper.stored_prefix.KeySpace), for the proxy's lookups;
# decode ignores it.
KEY_SPACE_KEY = "kvhelper_key_space"

# From the proxy to prefill: what its store lookup found for this prompt, so that prefill's
# connector need not ask the store again (its existence call stalls vLLM's scheduler):
# {"tokens": leading prompt tokens stored, "asked": blocks looked up, "last_hash": hex hash of
# the last of those (prefill trusts the answer only if its own hash of that block is the same),
# "key_space": KeySpace.to_json() of the keys asked}.
STORED_HINT_KEY = "kvhelper_stored"

# vLLM's own keys: the request's KV comes from elsewhere, and no peer is to be contacted.
_NO_PEER: dict[str, Any] = {"remote_engine_id": None, "remote_block_ids": None,
                            "remote_host": None, "remote_port": None}
# What prefill must be told so that vLLM keeps the KV for a remote decode.
REMOTE_DECODE: dict[str, Any] = {"do_remote_decode": True, "do_remote_prefill": False,
                                 **_NO_PEER}


def load_from_store(tokens: int, prefix_hash: str | None, identity: dict[str, Any] | None,
                    storing: bool = False) -> dict[str, Any]:
    """What tells decode to load a prompt's first `tokens` tokens from the store (`storing`:
    some may not be there yet, since prefill stores them in the background)."""
    params: dict[str, Any] = {"do_remote_prefill": True, "do_remote_decode": False, **_NO_PEER,
                              TOKENS_KEY: tokens, PREFIX_HASH_KEY: prefix_hash}
    if identity is not None:
        params[IDENTITY_KEY] = identity
    if storing:
        params[STORING_KEY] = True
    return params
