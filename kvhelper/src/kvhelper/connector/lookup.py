"""The scheduler side's view of the store: how many of a prompt's leading blocks it holds, so
that an instance loads a prefix any instance stored instead of computing it.

The keys are namespaced by the layout fingerprint, which only the workers know once their cache
is registered: a worker hands it over through vLLM's connector handshake (`StoreHandshake`).
The scheduler side asks the store with a client of its own that contributes no memory. A lookup
that fails counts as no hit, and lookups pause for a while after one: a request is computed,
never failed or held up, when the store cannot answer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvhelper.block_io import block_value_keys
from kvhelper.store import MooncakeConfig, MooncakeKVStore

log = logging.getLogger("vllm.kvhelper.connector")
PAUSE_AFTER_FAILURE = 10.0  # seconds without lookups after one failed
LOOKUP_BUFFER_BYTES = 1 << 20  # the lookup client moves no values


@dataclass
class StoreHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells the scheduler side once its cache is registered: how this instance's
    store keys are made."""
    fingerprint: str
    shards: int | None  # head shards per K/V block (every one must be stored); None: MLA


class StoreLookup:
    def __init__(self, config: MooncakeConfig,
                 connect: Callable[[MooncakeConfig], MooncakeKVStore] = MooncakeKVStore,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._config = replace(config, global_segment_size=0,
                               local_buffer_size=LOOKUP_BUFFER_BYTES)
        self._connect, self._clock = connect, clock
        self._client: MooncakeKVStore | None = None
        self._layout: StoreHandshake | None = None
        self._paused_until = 0.0

    def set_layout(self, handshake: StoreHandshake) -> None:
        self._layout = handshake

    @property
    def ready(self) -> bool:
        return self._layout is not None

    def stored_blocks(self, hashes: Sequence[str]) -> int | None:
        """How many of the blocks of `hashes` (hex), from the first, the store holds in full
        (every shard); 0 while lookups pause, None when the store could not answer."""
        layout = self._layout
        if layout is None or not hashes or self._clock() < self._paused_until:
            return 0
        per_block = block_value_keys(layout.fingerprint, hashes, layout.shards)
        try:
            if self._client is None:
                self._client = self._connect(self._config)
            found = self._client.exists([key for keys in per_block for key in keys],
                                       strict=True)
        except Exception as err:  # the store is out of reach: compute, and ask again later
            self._paused_until = self._clock() + PAUSE_AFTER_FAILURE
            log.warning("looking up stored KV blocks failed (%s); computing prompts without "
                        "the store for %.0f s", err, PAUSE_AFTER_FAILURE)
            return None
        width = len(per_block[0])
        blocks = 0
        while blocks < len(per_block) and all(found[blocks * width:(blocks + 1) * width]):
            blocks += 1
        return blocks

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
