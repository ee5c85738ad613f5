"""The Mooncake store as the connector uses it: configuration, and batch zero-copy page I/O with
Mooncake's return codes turned into results a caller can act on.

Configuration comes from `mooncake.json` (`mooncake_config_path` in kv_connector_extra_config,
else $MOONCAKE_CONFIG_PATH) with keys of kv_connector_extra_config layered on top; a key set to
two different values in the two places is an error, not a silent choice.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

# Mooncake reports errors as negative return codes.
ERROR_CODES = {
    -200: "no space (store full, or the master just restarted)",
    -600: "buffer too small",
    -704: "object not found",
    -706: "object has a lease",
    -800: "transfer failed",
    -900: "master RPC failed",
}
CONFIG_KEYS = ("master_server_address", "metadata_server", "protocol", "device_name",
               "global_segment_size", "local_buffer_size", "local_hostname")


def local_address(environ: Mapping[str, str]) -> str:
    """This host's address for peers: $POD_IP (the operator renders it), else the hostname's."""
    return environ.get("POD_IP") or socket.gethostbyname(socket.gethostname())


class ConfigError(ValueError):
    """Missing or contradictory Mooncake settings; the message names the setting and source."""


class StoreError(RuntimeError):
    def __init__(self, what: str, code: int) -> None:
        super().__init__(f"{what}: Mooncake code {code} ({describe(code)})")
        self.code = code


def describe(code: int) -> str:
    return ERROR_CODES.get(code, "unknown error")


@dataclass(frozen=True)
class MooncakeConfig:
    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 1 << 30
    local_buffer_size: int = 256 << 20
    # Where peers reach this store; in a pod, its IP ($POD_IP).
    local_hostname: str = field(default_factory=lambda: local_address(os.environ))

    @classmethod
    def load(cls, extra_config: Mapping[str, Any],
             environ: Mapping[str, str] = os.environ) -> MooncakeConfig:
        path_setting = ("kv_connector_extra_config.mooncake_config_path"
                        if extra_config.get("mooncake_config_path") else "MOONCAKE_CONFIG_PATH")
        path = extra_config.get("mooncake_config_path") or environ.get("MOONCAKE_CONFIG_PATH")
        from_file: dict[str, Any] = {}
        if path:
            try:
                from_file = json.loads(Path(path).read_text())
            except FileNotFoundError:
                raise ConfigError(f"{path_setting} points to {path}, which does not exist"
                                  ) from None
            except ValueError as err:
                raise ConfigError(f"{path} is not valid JSON: {err}") from None
            if not isinstance(from_file, dict):
                raise ConfigError(f"{path} must hold a JSON object")
        merged = {k: v for k, v in from_file.items() if k in CONFIG_KEYS}
        for key in CONFIG_KEYS:
            if key in extra_config:
                if key in from_file and from_file[key] != extra_config[key]:
                    raise ConfigError(
                        f"{key} is {extra_config[key]!r} in kv_connector_extra_config but "
                        f"{from_file[key]!r} in {path}: set it in one place")
                merged[key] = extra_config[key]
        if not merged.get("master_server_address"):
            raise ConfigError("master_server_address is not set: give it in mooncake.json "
                              "(mooncake_config_path or $MOONCAKE_CONFIG_PATH) or in "
                              "kv_connector_extra_config")
        merged.setdefault("local_hostname", local_address(environ))
        config = cls(**{f.name: merged[f.name] for f in fields(cls) if f.name in merged})
        config.validate()
        return config

    def validate(self) -> None:
        if self.protocol not in ("tcp", "rdma"):
            raise ConfigError(f"protocol must be tcp or rdma, not {self.protocol!r}")
        if self.protocol == "rdma" and not self.device_name:
            raise ConfigError("protocol rdma needs device_name (e.g. mlx5_0)")
        # A client may contribute no memory to the store (global_segment_size 0).
        for name, least in (("global_segment_size", 0), ("local_buffer_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name} must be a number of bytes >= {least}, not {value!r}")
        if not (self.metadata_server == "P2PHANDSHAKE"
                or self.metadata_server.startswith(("http://", "etcd://"))):
            raise ConfigError("metadata_server must be P2PHANDSHAKE, http://... or etcd://...; "
                              f"got {self.metadata_server!r}")
        for endpoint in master_endpoints(self.master_server_address):
            host, _, port = endpoint.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError("master_server_address must be host:port, or etcd://host:port"
                                  "[;host:port...] for masters in HA mode, not "
                                  f"{self.master_server_address!r}")


@dataclass
class PutResult:
    stored: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # already in the store
    failed: dict[str, int] = field(default_factory=dict)  # key -> Mooncake code


class MooncakeKVStore:
    """One Mooncake client: zero-copy batch puts and gets between registered buffers."""

    def __init__(self, config: MooncakeConfig) -> None:
        from mooncake.store import MooncakeDistributedStore

        self.config = config
        _check_reachable(config.master_server_address)
        self._store = MooncakeDistributedStore()
        code = self._store.setup(config.local_hostname, config.metadata_server,
                                 config.global_segment_size, config.local_buffer_size,
                                 config.protocol, config.device_name,
                                 config.master_server_address)
        if code != 0:
            raise StoreError(f"connecting to the Mooncake master at "
                             f"{config.master_server_address}", code)

    def register(self, buffer: torch.Tensor) -> None:
        self.register_range(buffer.data_ptr(), buffer.numel() * buffer.element_size())

    def unregister(self, buffer: torch.Tensor) -> None:
        self.unregister_range(buffer.data_ptr())

    def unregister_range(self, address: int) -> None:
        self._store.unregister_buffer(address)

    def exists(self, keys: Sequence[str], strict: bool = False) -> list[bool]:
        """Which keys the store holds; `strict` raises StoreError when it cannot say."""
        if not keys:
            return []
        codes = self._store.batch_is_exist(list(keys))
        if strict and (failed := [code for code in codes if code < 0]):
            raise StoreError("checking which KV blocks are stored", failed[0])
        return [code == 1 for code in codes]

    def put(self, keys: Sequence[str], pointers: Sequence[int], sizes: Sequence[int],
            skip_existing: bool = True) -> PutResult:
        """Store each (pointer, size) under its key; keys already stored are left alone."""
        return self._put(keys, skip_existing, lambda todo: self._store.batch_put_from(
            [keys[i] for i in todo], [pointers[i] for i in todo], [sizes[i] for i in todo]))

    def put_parts(self, keys: Sequence[str], parts: Sequence[Sequence[int]], part_bytes: int,
                  skip_existing: bool = True) -> PutResult:
        """Store each key's value from several equal-sized pieces (addresses in `parts`),
        concatenated in order: a KV block straight from the cache."""
        return self._put(keys, skip_existing, lambda todo: self._store.batch_put_from_multi_buffers(
            [keys[i] for i in todo], [list(parts[i]) for i in todo],
            [[part_bytes] * len(parts[i]) for i in todo]))

    def _put(self, keys: Sequence[str], skip_existing: bool,
             write: Callable[[list[int]], Sequence[int]]) -> PutResult:
        result = PutResult()
        todo = list(range(len(keys)))
        if skip_existing and keys:
            present = self.exists(keys)
            result.skipped = [keys[i] for i in todo if present[i]]
            todo = [i for i in todo if not present[i]]
        if todo:
            for i, code in zip(todo, write(todo), strict=True):
                if code == 0:
                    result.stored.append(keys[i])
                else:
                    result.failed[keys[i]] = int(code)
        return result

    def get(self, keys: Sequence[str], pointers: Sequence[int],
            sizes: Sequence[int]) -> dict[str, int]:
        """Read each key into its (pointer, size); returns the keys that failed, with codes
        (a value of the wrong size counts as -600)."""
        if not keys:
            return {}
        return _failures(keys, sizes, self._store.batch_get_into(list(keys), list(pointers),
                                                                 list(sizes)))

    def get_parts(self, keys: Sequence[str], parts: Sequence[Sequence[int]],
                  part_bytes: int) -> dict[str, int]:
        """Read each key's value into several equal-sized pieces, in order (the inverse of
        `put_parts`); returns the keys that failed, with codes."""
        if not keys:
            return {}
        results = self._store.batch_get_into_multi_buffers(
            list(keys), [list(p) for p in parts], [[part_bytes] * len(p) for p in parts])
        return _failures(keys, [part_bytes * len(p) for p in parts], results)

    def register_range(self, address: int, nbytes: int) -> None:
        code = self._store.register_buffer(address, nbytes)
        if code != 0:
            raise StoreError("registering memory for transfers", code)

    def size(self, key: str) -> int:
        """Bytes stored under key; StoreError when it is absent."""
        size = int(self._store.get_size(key))
        if size < 0:
            raise StoreError(f"reading the size of {key}", size)
        return size

    def remove(self, key: str, force: bool = False) -> None:
        """Delete key. Without force Mooncake refuses while a reader's lease on it is live
        (10 s after each read by default)."""
        code = int(self._store.remove(key, force))
        if code != 0:
            raise StoreError(f"removing {key}", code)

    def close(self) -> None:
        self._store.close()


def _failures(keys: Sequence[str], sizes: Sequence[int], results: Sequence[int]
              ) -> dict[str, int]:
    failed = {}
    for key, size, got in zip(keys, sizes, results, strict=True):
        if got < 0:
            failed[key] = int(got)
        elif got != size:
            failed[key] = -600
    return failed


def master_endpoints(address: str) -> list[str]:
    """host:port of the master, or of the etcd through which masters in HA mode are found
    (`etcd://a:2379;b:2379`: Mooncake's clients then follow the elected leader)."""
    if address.startswith("etcd://"):
        return [e for e in address.removeprefix("etcd://").split(";") if e]
    return [address]


def _check_reachable(address: str, timeout: float = 5.0) -> None:
    """Fail in seconds with a clear message; Mooncake's own setup retries for about 90 s.
    With masters in HA mode, one reachable etcd endpoint is enough."""
    problems = []
    for endpoint in master_endpoints(address):
        host, _, port = endpoint.rpartition(":")
        try:
            with socket.create_connection((host, int(port)), timeout=timeout):
                return
        except OSError as err:
            problems.append(f"{endpoint}: {err}")
    raise StoreError(f"connecting to the Mooncake master at {address} "
                     f"({'; '.join(problems)})", -900)
