"""The connector's settings, parsed once from `kv_connector_extra_config` into a frozen object
that the connector, `compat` and `store` all read (Mooncake's own keys, and `mooncake.json`,
are `kvhelper.store.MooncakeConfig`'s)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from kvhelper.block_io import DEFAULT_STAGING_BYTES

Transfer = Literal["auto", "direct", "staging"]


class SettingsError(ValueError):
    """A setting of kv_connector_extra_config with a value the connector cannot use."""


@dataclass(frozen=True)
class ConnectorSettings:
    # Loads of the pages prefill stored for decode: on a loader thread while the request
    # waits in WAITING_FOR_REMOTE_KVS (true), or inside the scheduler step (false).
    load_async: bool = True
    # Loads of a prefill instance's own store hits (store_lookup), the same way. In the step by
    # default: vLLM starts an asynchronous load after the step's forward and schedules the
    # request two steps later, which costs prefill's TTFT more than the read itself, while
    # decode's loads stay asynchronous so that its running sequences never wait for them.
    lookup_load_async: bool = False
    # How values move: "direct" between a host cache and the store, "staging" through a host
    # buffer (device caches need it), "auto" picks by where the cache lives.
    transfer: Transfer = "auto"
    staging_buffer_bytes: int = DEFAULT_STAGING_BYTES
    store_tp_size: int | None = None  # head shards per K/V block; None: the TP size
    # Prefill and kv_both instances look in the store for a new prompt's leading blocks and
    # load those instead of computing them.
    store_lookup: bool = True
    # Decode (and kv_both) instances store the full blocks of prompt plus generated tokens
    # when a request finishes, so that a conversation's next turn finds its whole history.
    save_decode_cache: bool = False
    # Stores run on a saver thread while the engine goes on with its next steps (vLLM keeps a
    # finished request's blocks until they are written), so prefill answers before its pages
    # are in the store; false stores them inside the step, before the request finishes.
    save_async: bool = True
    # How long decode waits for pages that prefill is still storing before it counts the
    # missing ones as failed (and recomputes them, by kv_load_failure_policy).
    store_wait_seconds: float = 5.0
    # The whole extra config, read-only (Mooncake's keys are kvhelper.store's to read).
    raw: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    @classmethod
    def parse(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        transfer = extra.get("transfer", "auto")
        if transfer not in ("auto", "direct", "staging"):
            raise SettingsError("kv_connector_extra_config.transfer must be auto, direct or "
                                f"staging, not {transfer!r}")
        staging = extra.get("staging_buffer_bytes", DEFAULT_STAGING_BYTES)
        if not _positive_int(staging):
            raise SettingsError("kv_connector_extra_config.staging_buffer_bytes must be a "
                                f"number of bytes, not {staging!r}")
        shards = extra.get("store_tp_size")
        if shards is not None and not _positive_int(shards):
            raise SettingsError("kv_connector_extra_config.store_tp_size must be a positive "
                                f"integer, not {shards!r}")
        flags = {name: extra.get(name, default) for name, default in
                 (("load_async", True), ("lookup_load_async", False), ("store_lookup", True),
                  ("save_decode_cache", False), ("save_async", True))}
        for name, value in flags.items():
            if not isinstance(value, bool):
                raise SettingsError(f"kv_connector_extra_config.{name} must be true or false, "
                                    f"not {value!r}")
        wait = extra.get("store_wait_seconds", 5.0)
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait <= 600:
            raise SettingsError("kv_connector_extra_config.store_wait_seconds must be a number "
                                f"of seconds from 0 to 600, not {wait!r}")
        return cls(load_async=flags["load_async"],
                   lookup_load_async=flags["lookup_load_async"], transfer=transfer,
                   staging_buffer_bytes=staging,
                   store_tp_size=shards, store_lookup=flags["store_lookup"],
                   save_decode_cache=flags["save_decode_cache"], save_async=flags["save_async"],
                   store_wait_seconds=float(wait), raw=MappingProxyType(extra))


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
