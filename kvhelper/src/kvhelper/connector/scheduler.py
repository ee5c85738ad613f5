"""The connector's scheduler side: which tokens of a request can be loaded and into which
blocks, which blocks a finished prompt stores, and what prefill tells decode. It runs in vLLM's
scheduler process and only describes work for the workers; its one I/O is asking the store which
blocks it holds (`lookup`), once per new request."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from kvhelper import compat
from kvhelper.connector.data import (
    IDENTITY_KEY,
    KEY_SPACE_KEY,
    PARAMS_KEY,
    PREFIX_HASH_KEY,
    MooncakeStoreConnectorMetadata,
    RequestRecord,
    Transfer,
)
from kvhelper.connector.lookup import StoreHandshake
from kvhelper.connector_metrics import TransferStats
from kvhelper.stored_prefix import KeySpace, StoredPrefixLookup
from kvhelper.transfer_params import STORED_HINT_KEY, STORING_KEY, load_from_store

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvhelper.connector")


class SchedulerSide:
    def __init__(self, block_size: int, is_producer: bool, is_consumer: bool,
                 identity: dict[str, Any], load_async: bool, stats: TransferStats,
                 lookup: StoredPrefixLookup | None = None, lookup_load_async: bool = False,
                 save_decode_cache: bool = False, save_async: bool = False,
                 store_wait_seconds: float = 0.0, loads_exact: bool = True) -> None:
        self.block_size = block_size
        # False where this engine would compute a prompt's tail over loaded blocks otherwise
        # than the whole prompt (`kvhelper.vllm_cpu_rope`): nothing is loaded, all computed.
        self.loads_exact = loads_exact
        self.is_producer, self.is_consumer = is_producer, is_consumer
        self.identity = identity
        self.load_async = load_async
        self.lookup_load_async = lookup_load_async
        self.stats = stats
        # Asked for requests that carry no prefill parameters, on instances that prefill.
        self.lookup = lookup if is_producer else None
        # This instance's store keys, from the workers' handshake: for lookups, and told to the
        # proxy with every stored prompt so that it can ask the store too.
        self.key_space: KeySpace | None = None
        self.save_decode_cache = save_decode_cache and is_consumer
        # Stores end after the step (the workers say when): vLLM holds the blocks till then.
        self.save_async = save_async
        self.store_wait_seconds = store_wait_seconds
        self._records: dict[str, RequestRecord] = {}
        self._loads: list[Transfer] = []
        self._finished_saves: list[Transfer] = []  # decode saving, for the next step

    def _record(self, request: Request) -> RequestRecord:
        record = self._records.get(request.request_id)
        if record is None:
            record = self._records[request.request_id] = RequestRecord(request)
        return record

    # -- decode: what can be loaded, and where -----------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the `num_computed_tokens` of the local prefix-cache hit that decode can
        load: the whole blocks prefill stored, short of the prompt's last token."""
        if not self.loads_exact:
            return 0, False
        params = request.kv_transfer_params or {}
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return self._stored_prefix(request, num_computed_tokens)
        record = self._record(request)
        if record.refused or record.load_scheduled:
            return 0, False
        stored = int(params.get(PARAMS_KEY) or 0)
        # vLLM must compute at least the last prompt token itself.
        limit = request.num_prompt_tokens - 1
        blocks = min(stored, limit, len(request.block_hashes) * self.block_size) \
            // self.block_size
        if blocks and not self._compatible(request, params, stored // self.block_size):
            record.refused = True
            self.stats.count("requests_refused")
            return 0, False
        external = max(0, blocks * self.block_size - num_computed_tokens)
        record.local_hit_tokens = num_computed_tokens if external else None
        record.wait_seconds = self.store_wait_seconds if params.get(STORING_KEY) else 0.0
        record.load_async = self.load_async
        return external, self.load_async and external > 0

    def _stored_prefix(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens after the local prefix-cache hit whose blocks the store holds, whoever
        stored them (prefill's own lookup)."""
        if self.lookup is None or self.key_space is None:
            return 0, False
        record = self._record(request)
        if record.load_scheduled:  # resumed after preemption: the pages may be gone
            return 0, False
        first = num_computed_tokens // self.block_size
        # vLLM must compute at least the last prompt token itself.
        last = min(len(request.block_hashes), (request.num_prompt_tokens - 1) // self.block_size)
        if last <= first:
            return 0, False
        if record.stored_prefix is not None and record.stored_prefix[0] == first:
            found: int | None = record.stored_prefix[1]  # asked again: no new lookup
        elif (hinted := self._hinted_blocks(request)) is not None:
            found = max(0, min(hinted, last) - first)  # the proxy looked: no lookup here
            self.stats.count("lookup_hints")
            record.stored_prefix = (first, found)
        else:
            started = time.perf_counter()
            found = self.lookup.stored_blocks(
                self.key_space, [bytes(h).hex() for h in request.block_hashes[first:last]])
            self.stats.observe("lookup_seconds", time.perf_counter() - started)
            self.stats.count("lookups")
            if found is None:
                self.stats.count("lookups_failed")
            record.stored_prefix = (first, found or 0)
        if not found:
            return 0, False
        self.stats.count("lookup_hit_blocks", found)
        record.local_hit_tokens = num_computed_tokens
        record.load_async = self.lookup_load_async
        return found * self.block_size, self.lookup_load_async

    def _hinted_blocks(self, request: Request) -> int | None:
        """Leading blocks the proxy found stored for this prompt (transfer_params'
        STORED_HINT_KEY), if it asked this instance's keys and hashed the prompt as vLLM did
        (its hash of the last block it asked is this request's); None: look it up here."""
        hint = (request.kv_transfer_params or {}).get(STORED_HINT_KEY)
        if not isinstance(hint, dict):
            return None
        tokens, asked, last_hash = hint.get("tokens"), hint.get("asked"), hint.get("last_hash")
        if not (isinstance(tokens, int) and isinstance(asked, int)
                and 0 < asked <= len(request.block_hashes) and 0 <= tokens <= asked
                * self.block_size and KeySpace.from_json(hint.get("key_space")) == self.key_space
                and bytes(request.block_hashes[asked - 1]).hex() == last_hash):
            return None
        return tokens // self.block_size

    def set_layout(self, handshake: StoreHandshake) -> None:
        self.key_space = handshake.key_space

    def _compatible(self, request: Request, params: dict[str, Any], stored_blocks: int) -> bool:
        theirs = params.get(IDENTITY_KEY)
        if isinstance(theirs, dict) and (problems := compat.differences(theirs, self.identity)):
            log.warning("request %s: prefill's KV cannot be used here (%s); recomputing the "
                        "prompt", request.request_id, "; ".join(problems))
            return False
        prefix_hash = params.get(PREFIX_HASH_KEY)
        if prefix_hash and stored_blocks <= len(request.block_hashes):
            ours = bytes(request.block_hashes[stored_blocks - 1]).hex()
            if ours != prefix_hash:
                log.warning("request %s: this instance hashes the prompt differently from "
                            "prefill (its tokens, hash algorithm or PYTHONHASHSEED differ), so "
                            "no stored page can match; recomputing the prompt",
                            request.request_id)
                return False
        return True

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        record = self._record(request)
        record.block_ids = list(blocks.get_block_ids()[0])
        local_hit, record.local_hit_tokens = record.local_hit_tokens, None
        if num_external_tokens <= 0:
            return
        if local_hit is None:  # vLLM asks before it allocates; never guess where to write
            raise RuntimeError(f"request {request.request_id}: vLLM allocated "
                               f"{num_external_tokens} external tokens the connector did not "
                               "offer")
        # Never onto the locally cached blocks: those may be shared with other requests.
        first = local_hit // self.block_size
        count = num_external_tokens // self.block_size
        hashes = [bytes(h).hex() for h in request.block_hashes[first:first + count]]
        self._loads.append(Transfer(request.request_id, hashes,
                                    record.block_ids[first:first + count],
                                    wait_seconds=record.wait_seconds,
                                    asynchronous=record.load_async))
        record.load_scheduled = True

    # -- prefill: what is stored ---------------------------------------------------------------

    def build_connector_meta(self, scheduler_output: SchedulerOutput
                             ) -> MooncakeStoreConnectorMetadata:
        meta = MooncakeStoreConnectorMetadata(loads=self._loads, saves=self._finished_saves)
        self._loads, self._finished_saves = [], []
        if self.save_async:
            meta.preempted = sorted(scheduler_output.preempted_req_ids or ())
        if not self.is_producer:
            return meta
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            record = self._records.get(req_id)
            if new_ids is None or record is None:
                continue
            if req_id in cached.resumed_req_ids:  # preempted and resumed: all of its blocks
                record.block_ids = list(new_ids[0])
            else:
                record.block_ids.extend(new_ids[0])
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            record = self._records.get(req_id)
            if record is None or record.saved_tokens is not None:
                continue
            request = record.request
            if request.num_computed_tokens + scheduled < request.num_prompt_tokens:
                continue  # the prompt is still being prefilled (chunked)
            full = min(len(request.block_hashes), request.num_prompt_tokens // self.block_size)
            hashes = [bytes(h).hex() for h in request.block_hashes[:full]]
            meta.saves.append(Transfer(req_id, hashes, record.block_ids[:full]))
            # Every full block is stored (a longer prompt may share them), but decode must
            # compute the last prompt token itself: tell it of the blocks before that token, so
            # that the prefix hash it checks is that of the last block it will really read.
            usable = min(full, (request.num_prompt_tokens - 1) // self.block_size)
            record.saved_tokens = usable * self.block_size
            record.prefix_hash = hashes[usable - 1] if usable else None
        return meta

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """Whether vLLM must keep the request's blocks until a store of them is done (decode
        saving, or a prompt's asynchronous store), and the kv_transfer_params for decode, for
        a prompt this instance stored."""
        record = self._records.pop(request.request_id, None)
        hold = self._save_after_decode(request, block_ids)
        if not self.is_producer or record is None or record.saved_tokens is None:
            return hold, None
        # The workers were given the prompt's store; asynchronous, it may not have ended.
        hold = hold or self.save_async
        params = load_from_store(record.saved_tokens, record.prefix_hash, self.identity,
                                 storing=self.save_async)
        if self.key_space is not None:
            params[KEY_SPACE_KEY] = self.key_space.to_json()
        return hold, params

    def _save_after_decode(self, request: Request, block_ids: list[int]) -> bool:
        """With save_decode_cache, schedule storing the finished request's full blocks whose
        KV is computed (prompt and generated tokens; the last sampled token has none)."""
        if not self.save_decode_cache:
            return False
        full = min(len(request.block_hashes), request.num_computed_tokens // self.block_size,
                   len(block_ids))
        if full <= 0:
            return False
        hashes = [bytes(h).hex() for h in request.block_hashes[:full]]
        self._finished_saves.append(Transfer(request.request_id, hashes, list(block_ids[:full]),
                                             release=True))
        return True

    def shutdown(self) -> None:
        if self.lookup is not None:
            self.lookup.close()
