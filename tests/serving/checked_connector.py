"""A test probe: the kvhelper connector, recording every load vLLM's scheduler asks of it beside
the request's own blocks at that moment, so a test can check that no loaded block is one the
request already had computed. What the request had computed is the local prefix-cache hit
vLLM passed to `get_num_new_matched_tokens`, and, for asynchronous loads (whose blocks vLLM
hashes only once loaded), every block that already carries a hash. One JSON line per load,
appended to $KVHELPER_LOAD_RECORD.

Engines load it with `kv_connector_module_path: checked_connector` and this folder on
PYTHONPATH (run_engine does both)."""

from __future__ import annotations

import json
import os
from typing import Any

from kvhelper.connector import MooncakeStoreConnector as _Connector


class MooncakeStoreConnector(_Connector):
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

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
        if resumed:
            _record({"resumed": sorted(resumed)})
        return super().build_connector_meta(scheduler_output)


def _record(line: dict[str, Any]) -> None:
    with open(os.environ["KVHELPER_PROBE_RECORD"], "a") as out:
        out.write(json.dumps(line) + "\n")
