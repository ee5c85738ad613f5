"""A test probe: the kvhelper connector, recording every load vLLM's scheduler asks of it beside
the request's own blocks at that moment, so a test can check that no loaded block is one the
request already had computed. What the request had computed is the local prefix-cache hit
vLLM passed to `get_num_new_matched_tokens`, and, for asynchronous loads (whose blocks vLLM
hashes only once loaded), every block that already carries a hash. One JSON line per load,
appended to $KVHELPER_LOAD_RECORD.

With $KVHELPER_PROBE_SAVE_DELAY (seconds), the worker's asynchronous stores wait that long
before they read the pages, and each store records whether the pages it reads still hold the
bytes the step computed (`"changed"`), which preempted requests still had a store running
(`"preempted_while_saving"`), and any forward that runs while such a store still reads blocks
vLLM has freed (`"forward_while_saving"`). $KVHELPER_PROBE_NO_PREEMPT_WAIT=1 removes the
connector's wait for those stores before the step's forward (a negative control).

With $KVHELPER_PROBE_DIGESTS=1, the bytes of every block are recorded as a digest per block
hash: each block a step computed and stores (`"saved"`), and each block a load filled, once
filled (`"loaded"`), so a test can compare them block by block.

Engines load it with `kv_connector_module_path: checked_connector` and this folder on
PYTHONPATH (run_engine does both)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from typing import Any

from kvhelper.connector import MooncakeStoreConnector as _Connector
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

SAVE_DELAY = float(os.environ.get("KVHELPER_PROBE_SAVE_DELAY") or 0)
DIGESTS = os.environ.get("KVHELPER_PROBE_DIGESTS") == "1"


class MooncakeStoreConnector(_Connector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._computed: dict[str, str] = {}  # request -> digest of its pages after the step
        self._freed: set[str] = set()  # preempted requests whose store was still running

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        external, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        self._probe = (request.request_id, num_computed_tokens, load_async)
        return external, load_async

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        loads = self.scheduler._loads  # what the scheduler side will send the workers
        before = len(loads)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        if len(loads) == before:
            return
        req_id, local_tokens, load_async = self._probe
        assert req_id == request.request_id  # vLLM allocates right after asking
        own = blocks.blocks[0]
        record = {"request": req_id, "num_external_tokens": num_external_tokens,
                  "block_ids": [block.block_id for block in own],
                  "local_hit_block_ids": [block.block_id for block in
                                          own[:local_tokens // self.scheduler.block_size]],
                  "hashed_block_ids": [block.block_id for block in own
                                       if block.block_hash is not None],
                  "load_async": load_async,
                  "loaded_block_ids": list(loads[-1].block_ids)}
        _record(record)

    # -- worker side: asynchronous stores --------------------------------------------------

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Runs before each step's forward: records preempted requests whose store was still
        running, and a forward about to run while one still is (blocks vLLM has freed)."""
        if SAVE_DELAY:
            preempted = [req for req in connector_metadata.preempted if self._storing(req)]
            if preempted:
                _record({"preempted_while_saving": preempted})
                self._freed.update(preempted)
        if os.environ.get("KVHELPER_PROBE_NO_PREEMPT_WAIT") == "1":
            KVConnectorBase_V1.bind_connector_metadata(self, connector_metadata)
        else:
            super().bind_connector_metadata(connector_metadata)
        if SAVE_DELAY:
            self._freed = {req for req in self._freed if self._storing(req)}
            if self._freed:
                _record({"forward_while_saving": sorted(self._freed)})

    def _storing(self, req_id: str) -> bool:
        return not all(future.done() for future in self.worker._saving.get(req_id, ()))

    def register_kv_caches(self, kv_caches: Any) -> None:
        super().register_kv_caches(kv_caches)
        if DIGESTS:
            worker, account = self.worker, self.worker._account

            def digested(outcome: Any) -> None:
                load = outcome.load
                _record({"loaded": [[h, self._digest([b])] for h, b in zip(
                    load.block_hashes[:outcome.good], load.block_ids[:outcome.good],
                    strict=True)]})
                account(outcome)

            worker._account = digested

    def wait_for_save(self) -> None:
        if DIGESTS:
            for save in self._get_connector_metadata().saves:
                _record({"saved": [[h, self._digest([b])] for h, b in zip(
                    save.block_hashes, save.block_ids, strict=False)]})
        if not SAVE_DELAY:
            return super().wait_for_save()
        worker = self.worker
        if "_store_pages" not in vars(worker):
            worker._store_pages = self._delayed(worker._store_pages)
        self._computed.update({save.req_id: self._digest(save.block_ids)
                               for save in self._get_connector_metadata().saves})
        return super().wait_for_save()

    def _digest(self, block_ids: list[int]) -> str:
        return hashlib.sha256(self.worker._mover.gather(block_ids).numpy().tobytes()).hexdigest()

    def _delayed(self, store: Any) -> Any:
        def run(save: Any, ready: Any) -> Any:
            computed = self._computed[save.req_id]
            time.sleep(SAVE_DELAY)
            _record({"stored": save.req_id,
                     "changed": self._digest(save.block_ids) != computed})
            return store(save, ready)

        return run

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        if resumed:
            _record({"resumed": sorted(resumed)})
        return super().build_connector_meta(scheduler_output)


def _record(line: dict[str, Any]) -> None:
    with open(os.environ["KVHELPER_PROBE_RECORD"], "a") as out:
        out.write(json.dumps(line) + "\n")
