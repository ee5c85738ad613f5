"""What a worker tells the scheduler side once its cache is registered: the key space of this
instance's store keys, which only the workers can know (it depends on the cache's layout)."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvhelper.stored_prefix import KeySpace


@dataclass
class StoreHandshake(KVConnectorHandshakeMetadata):
    fingerprint: str
    shards: int | None  # head shards per K/V block (every one must be stored); None: MLA

    @property
    def key_space(self) -> KeySpace:
        return KeySpace(self.fingerprint, self.shards)
