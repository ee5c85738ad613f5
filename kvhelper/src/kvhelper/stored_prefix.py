"""How many of a prompt's leading blocks the store holds: asked by an instance's scheduler side
before it computes a prompt, and by the proxy before it decides whether a prompt needs prefill.

Store keys are namespaced by a `KeySpace`: the layout fingerprint of the instances that wrote
them and their head shards per block. The client that asks contributes no memory to the store.
A lookup that fails counts as no hit, and lookups pause for a while after one: a prompt is
computed, never failed or held up, when the store cannot answer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, replace
from typing import Any

from kvhelper.block_io import block_value_keys
from kvhelper.store import MooncakeConfig, MooncakeKVStore

log = logging.getLogger("kvhelper.stored_prefix")
PAUSE_AFTER_FAILURE = 10.0  # seconds without lookups after one failed
LOOKUP_BUFFER_BYTES = 1 << 20  # the lookup client moves no values
LOOKUP_TIMEOUT = 1.0  # seconds a lookup may take before the prompt is computed instead


@dataclass(frozen=True)
class KeySpace:
    """How one layout's store keys are made (`kvhelper.keys`)."""
    fingerprint: str  # the cache layout's fingerprint
    shards: int | None  # head shards per K/V block (every one must be stored); None: MLA

    def to_json(self) -> dict[str, Any]:
        return {"fingerprint": self.fingerprint, "shards": self.shards}

    @classmethod
    def from_json(cls, data: object) -> KeySpace | None:
        """From `to_json`'s form; None for anything else (an older or foreign instance)."""
        if not isinstance(data, Mapping):
            return None
        fingerprint, shards = data.get("fingerprint"), data.get("shards")
        if not isinstance(fingerprint, str) or not fingerprint:
            return None
        if shards is not None and (not isinstance(shards, int) or isinstance(shards, bool)
                                   or shards < 1):
            return None
        return cls(fingerprint, shards)


class LookupBusy(Exception):
    """Every lookup worker still waits on the store."""


class StoredPrefixLookup:
    def __init__(self, config: MooncakeConfig,
                 connect: Callable[[MooncakeConfig], MooncakeKVStore] = MooncakeKVStore,
                 clock: Callable[[], float] = time.monotonic,
                 pause_after_failure: float = PAUSE_AFTER_FAILURE,
                 timeout: float = LOOKUP_TIMEOUT, workers: int = 1) -> None:
        self._timeout = timeout
        # Existence checks run on these threads: a hung master holds them, never the caller
        # (vLLM's scheduler, which would stop every request with it). One per caller that
        # may ask at once: vLLM's scheduler asks one at a time, the proxy several.
        self._workers = workers
        self._worker = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kv-lookup")
        self._pending: set[Future[int]] = set()
        self._lock = threading.Lock()  # the pending set
        self._connecting = threading.Lock()  # (held while connecting: never by a caller)
        self._config = replace(config, global_segment_size=0,
                               local_buffer_size=LOOKUP_BUFFER_BYTES)
        self._connect, self._clock = connect, clock
        self._pause = pause_after_failure
        self._client: MooncakeKVStore | None = None
        self._paused_until = 0.0

    @property
    def paused(self) -> bool:
        """Lookups pause for a while after one failed."""
        return self._clock() < self._paused_until

    def stored_blocks(self, space: KeySpace, hashes: Sequence[str]) -> int | None:
        """How many of the blocks of `hashes` (hex), from the first, the store holds in full
        (every shard) under `space`; 0 while lookups pause, None when the store could not
        answer within the timeout."""
        try:
            return self.submit(space, hashes).result(timeout=self._timeout)
        except LookupBusy:
            return None
        except Exception as err:
            self.failed(err)
            return None

    def submit(self, space: KeySpace, hashes: Sequence[str]) -> Future[int]:
        """`stored_blocks`' question, asked on a worker thread, for a caller that waits its own
        way (the proxy's event loop: one thread hand-over, not two). The future holds the
        blocks found, or why the store could not say (give it to `failed`). Done at once
        with 0 for no hashes or while lookups pause; raises LookupBusy when every worker still
        waits on the store (it does not queue)."""
        if not hashes or self.paused:
            done: Future[int] = Future()
            done.set_result(0)
            return done
        per_block = block_value_keys(space.fingerprint, hashes, space.shards)
        with self._lock:
            self._pending = {f for f in self._pending if not f.done()}
            if len(self._pending) >= self._workers:
                raise LookupBusy
            pending = self._worker.submit(self._ask, per_block)
            self._pending.add(pending)
        return pending

    def failed(self, err: BaseException) -> None:
        """A lookup could not be answered: the store is out of reach or hung. Prompts are
        computed without it for a while."""
        self._paused_until = self._clock() + self._pause
        why = (f"no answer within {self._timeout:g} s" if isinstance(err, FutureTimeout)
               else str(err) or type(err).__name__)
        log.warning("looking up stored KV blocks failed (%s); computing prompts without the "
                    "store for %.0f s", why, self._pause)

    def _ask(self, per_block: list[list[str]]) -> int:
        with self._connecting:
            if self._client is None:  # connecting checks the master answers
                self._client = self._connect(self._config)
            client = self._client
        found = client.exists([key for keys in per_block for key in keys], strict=True)
        width = len(per_block[0])
        blocks = 0
        while blocks < len(per_block) and all(found[blocks * width:(blocks + 1) * width]):
            blocks += 1
        return blocks

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self._client is not None:
            self._client.close()
            self._client = None
