"""MooncakeStoreConnector: a vLLM v1 KV connector that moves whole KV pages through a Mooncake
store, keyed by vLLM's chained block hashes (so equal prefixes share pages) and namespaced by the
layout fingerprint (so incompatible instances never read each other's pages).

Producer (prefill): after the forward pass that completes a prompt, its full blocks are stored,
one value per block (existing keys are skipped); `request_finished` tells the client, through
`kv_transfer_params`, how many tokens decode can load. Consumer (decode): for a request carrying
those parameters, the full blocks are loaded into the blocks vLLM allocated before the forward
pass; a page that cannot be read is reported per block so vLLM recomputes or fails, as its
`kv_load_failure_policy` says. Loads are asynchronous: the request waits in vLLM's
WAITING_FOR_REMOTE_KVS state while one loader thread reads its pages, and other requests keep
running. `kv_connector_extra_config: {"load_async": false}` reads them inside the scheduler
step instead.

When the cache is in host memory (vLLM's CPU build), values go straight between the cache and
the store, one piece per layer and region of a block (Mooncake's multi-buffer batch calls):
no staging copy. A device cache goes through a registered host buffer of
`staging_buffer_bytes` (256 MiB by default), chunk by chunk (`kvhelper.block_io`);
`transfer: staging` makes a host cache take that path too.

K/V pages are stored as `store_tp_size` shards of heads per block (`kvhelper.tp`; default: the
instance's TP size), so that prefill and decode instances with different TP sizes exchange
pages when both set the same `store_tp_size` in kv_connector_extra_config.

Prefill also sends its identity and the hash of its last stored block, so a decode instance
that could never use those pages (another model, block size, dtype or prompt hashing) refuses
them up front with a message naming the difference, and recomputes. Counters and timings go
through vLLM's connector-stats path (`kvhelper.connector_metrics`).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed import get_tensor_model_parallel_rank
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvhelper import compat
from kvhelper.block_io import DEFAULT_STAGING_BYTES, DirectBlockIO, LoadJob, StagedBlockIO
from kvhelper.connector_metrics import TransferPromMetrics, TransferStats
from kvhelper.keys import block_key
from kvhelper.layout import LayoutError, ModelKVSpec, describe_kv_caches
from kvhelper.pages import PageMover
from kvhelper.store import MooncakeConfig, MooncakeKVStore
from kvhelper.tp import StoreSharding, store_sharding

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

# Under "vllm" so that vLLM's logging configuration (format, level) applies to our lines.
log = logging.getLogger("vllm.kvhelper.connector")
# In kv_transfer_params, from prefill to decode:
PARAMS_KEY = "kvhelper_tokens"  # how many prompt tokens decode can load (whole blocks)
IDENTITY_KEY = "kvhelper_identity"  # compat.identity() of the prefill instance
PREFIX_HASH_KEY = "kvhelper_prefix_hash"  # hex block hash of the last block decode can load


@dataclass
class Transfer:
    req_id: str
    block_hashes: list[str]  # hex, one per block, in order
    block_ids: list[int]


@dataclass
class LoadOutcome:
    """What reading one request's pages gave: the first `good` blocks are in place."""
    load: Transfer
    good: int
    errors: list[int]  # store error codes of the failed keys
    seconds: float


@dataclass
class MooncakeStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)


class MooncakeStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.block_size = int(vllm_config.cache_config.block_size)
        self.is_producer = bool(transfer.is_kv_producer)
        self.is_consumer = bool(transfer.is_kv_consumer)
        self.extra = dict(transfer.kv_connector_extra_config or {})
        self.identity = compat.identity(vllm_config)  # refuses unshareable settings at start
        self.load_async = self.extra.get("load_async", True)
        if not isinstance(self.load_async, bool):
            raise ValueError("kv_connector_extra_config.load_async must be true or false, not "
                             f"{self.load_async!r}")
        # How values move: "direct" between a host cache and the store, "staging" through a
        # host buffer (device caches need it), "auto" picks by where the cache lives.
        self._transfer = self.extra.get("transfer", "auto")
        if self._transfer not in ("auto", "direct", "staging"):
            raise ValueError("kv_connector_extra_config.transfer must be auto, direct or "
                             f"staging, not {self._transfer!r}")
        self._staging_bytes = self.extra.get("staging_buffer_bytes", DEFAULT_STAGING_BYTES)
        if isinstance(self._staging_bytes, bool) or not isinstance(self._staging_bytes, int) \
                or self._staging_bytes < 1:
            raise ValueError("kv_connector_extra_config.staging_buffer_bytes must be a number "
                             f"of bytes, not {self._staging_bytes!r}")
        self.stats = TransferStats()
        # Scheduler side
        self._requests: dict[str, Request] = {}
        self._block_ids: dict[str, list[int]] = {}
        self._loads: list[Transfer] = []
        # Tokens of each request's local prefix-cache hit, as vLLM passed them when it asked
        # what could be loaded: the load starts right after them. (Not the request's
        # num_computed_tokens: vLLM sets that only after update_state_after_alloc.)
        self._local_hits: dict[str, int] = {}
        self._saved_tokens: dict[str, int] = {}
        self._prefix_hashes: dict[str, str] = {}
        # Worker side
        self._store: MooncakeKVStore | None = None
        self._mover: PageMover | None = None
        self._io: DirectBlockIO | StagedBlockIO | None = None
        self._fingerprint = ""
        self._sharding: StoreSharding | None = None  # None: rank-agnostic (MLA) pages
        self._failed_blocks: set[int] = set()
        # One thread: loads run in order.
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future[LoadOutcome]] = {}
        if role == KVConnectorRole.WORKER:
            # Fail at start-up, not at the first request, on missing or contradictory settings.
            self._config = MooncakeConfig.load(self.extra)

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params or {}
        if not (self.is_consumer and params.get("do_remote_prefill")):
            return 0, False
        stored = int(params.get(PARAMS_KEY) or 0)
        # vLLM must compute at least the last prompt token itself.
        limit = request.num_prompt_tokens - 1
        blocks = min(stored, limit, len(request.block_hashes) * self.block_size) \
            // self.block_size
        if blocks and not self._compatible(request, params, stored // self.block_size):
            params["do_remote_prefill"] = False
            self.stats.count("requests_refused")
            return 0, False
        external = max(0, blocks * self.block_size - num_computed_tokens)
        if external:
            self._local_hits[request.request_id] = num_computed_tokens
        return external, self.load_async and external > 0

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
        self._requests[request.request_id] = request
        block_ids = list(blocks.get_block_ids()[0])
        self._block_ids[request.request_id] = block_ids
        local_hit = self._local_hits.pop(request.request_id, 0)
        if num_external_tokens <= 0:
            return
        # Never onto the locally cached blocks: those may be shared with other requests.
        first = local_hit // self.block_size
        count = num_external_tokens // self.block_size
        hashes = [bytes(h).hex() for h in request.block_hashes[first:first + count]]
        self._loads.append(Transfer(request.request_id, hashes, block_ids[first:first + count]))
        # Loaded once: a preempted and resumed request recomputes instead of reloading.
        if request.kv_transfer_params is not None:
            request.kv_transfer_params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = MooncakeStoreConnectorMetadata(loads=self._loads)
        self._loads = []
        if not self.is_producer:
            return meta
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if new_ids is None or req_id not in self._block_ids:
                continue
            if req_id in cached.resumed_req_ids:  # preempted and resumed: all of its blocks
                self._block_ids[req_id] = list(new_ids[0])
            else:
                self._block_ids[req_id].extend(new_ids[0])
        for req_id, scheduled in scheduler_output.num_scheduled_tokens.items():
            request = self._requests.get(req_id)
            if request is None or req_id in self._saved_tokens:
                continue
            done = request.num_computed_tokens + scheduled
            if done < request.num_prompt_tokens:
                continue  # the prompt is still being prefilled (chunked)
            full = min(len(request.block_hashes), request.num_prompt_tokens // self.block_size)
            hashes = [bytes(h).hex() for h in request.block_hashes[:full]]
            meta.saves.append(Transfer(req_id, hashes, self._block_ids[req_id][:full]))
            # Every full block is stored (a longer prompt may share them), but decode must
            # compute the last prompt token itself: tell it of the blocks before that token, so
            # that the prefix hash it checks is that of the last block it will really read.
            usable = min(full, (request.num_prompt_tokens - 1) // self.block_size)
            self._saved_tokens[req_id] = usable * self.block_size
            if usable:
                self._prefix_hashes[req_id] = hashes[usable - 1]
        return meta

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._requests.pop(req_id, None)
        self._block_ids.pop(req_id, None)
        self._local_hits.pop(req_id, None)
        saved = self._saved_tokens.pop(req_id, None)
        prefix_hash = self._prefix_hashes.pop(req_id, None)
        if not self.is_producer or saved is None:
            return False, None
        # Saving happened in the forward pass that finished the prompt: the blocks can go.
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       PARAMS_KEY: saved, IDENTITY_KEY: self.identity,
                       PREFIX_HASH_KEY: prefix_hash, "remote_engine_id": None,
                       "remote_block_ids": None, "remote_host": None, "remote_port": None}

    # -- worker side ------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The worker's own rank: GQA pages are keyed by it, and only rank 0 stores MLA pages.
        spec = ModelKVSpec.from_vllm_config(self._vllm_config,
                                            tp_rank=get_tensor_model_parallel_rank())
        layout = describe_kv_caches(kv_caches, spec)
        self._mover = PageMover(layout, kv_caches)
        self._fingerprint = layout.fingerprint()
        if not layout.rank_agnostic:
            self._sharding = store_sharding(spec.total_kv_heads, spec.tp_size, spec.tp_rank,
                                            self.extra.get("store_tp_size"))
            if self._sharding.local_shards > 1:
                try:
                    self._mover.piece_bytes(self._sharding.piece_heads()[0])
                except LayoutError as err:
                    raise LayoutError(
                        f"store_tp_size {self._sharding.shards} splits each rank's pages into "
                        f"{self._sharding.local_shards} head shards, but {err}; set "
                        f"store_tp_size to the TP size ({spec.tp_size}) on every instance"
                    ) from None
        self._store = MooncakeKVStore(self._config)
        heads = [None] if self._sharding is None else self._sharding.piece_heads()
        if self._transfer == "direct" or (self._transfer == "auto"
                                          and self._mover.device.type == "cpu"):
            self._io = DirectBlockIO(self._store, self._mover, heads)
        else:
            self._io = StagedBlockIO(self._store, self._mover, heads, self._staging_bytes)
        sharding = self._sharding
        log.info("kvhelper connector ready: %s, fingerprint %s, %s, %s", layout.describe(),
                 self._fingerprint, self._io.describe(),
                 "rank-agnostic pages" if sharding is None else
                 f"store shards {list(sharding.shard_ids)} of {sharding.shards}"
                 + ("" if sharding.writes else " (read only: another rank stores these heads)"))

    @property
    def _shards_per_block(self) -> int:
        return 1 if self._sharding is None else self._sharding.local_shards

    def _keys(self, hashes: list[str]) -> list[str]:
        """Store keys, block-major: each block's shards in order."""
        sharding = self._sharding
        if sharding is None:
            return [block_key(self._fingerprint, h) for h in hashes]
        return [block_key(self._fingerprint, h, (sharding.shards, shard))
                for h in hashes for shard in sharding.shard_ids]

    @property
    def _value_bytes(self) -> int:
        """Bytes of one store value: a block's pages (of this rank's shard) in every layer."""
        assert self._mover is not None
        layout = self._mover.layout
        return layout.page_bytes * layout.num_layers // self._shards_per_block

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeStoreConnectorMetadata)
        assert self._mover is not None
        for load in meta.loads:
            # Keys and addresses here, so that the loader thread needs the GIL as little as
            # possible: vLLM's busy loop holds it, and each hand-over can cost a switch interval.
            started = time.perf_counter()
            keys = self._keys(load.block_hashes)
            assert self._io is not None
            job = self._io.load_job(keys, load.block_ids)
            if self.load_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvhelper-load")
                self._loading[load.req_id] = self._loader.submit(self._read, load, keys, job,
                                                                 started)
            else:
                self._account(self._read(load, keys, job, started))

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous loads are over, failed blocks included (they are in
        `get_block_ids_with_load_errors`, which vLLM asks right after this, in the same step)."""
        done = {req_id for req_id, future in self._loading.items() if future.done()}
        for req_id in done:
            self._account(self._loading.pop(req_id).result())
        return None, done or None

    def _read(self, load: Transfer, keys: list[str], job: LoadJob,
              started: float) -> LoadOutcome:
        """Read a request's pages into its blocks (on the loader thread when loads are async).
        The time counts from `started`, when the load was asked for."""
        try:
            failed = job()
        except Exception as err:  # never lose a request's completion: count it all as failed
            log.warning("request %s: reading KV pages failed: %s", load.req_id, err)
            failed = dict.fromkeys(keys, -1)
        # Pages after the first missing one are useless: a prefix must be contiguous. (Blocks
        # reported as failed are recomputed, so bytes a direct read left in them do not matter.)
        first_failed = next((i for i, key in enumerate(keys) if key in failed), len(keys))
        good = first_failed // self._shards_per_block
        return LoadOutcome(load, good, sorted(set(failed.values())),
                           time.perf_counter() - started)

    def _account(self, outcome: LoadOutcome) -> None:
        """Report a finished load: failed blocks to vLLM, counts to the stats, a log line."""
        load, good = outcome.load, outcome.good
        total = len(load.block_ids)
        if good < total:
            self._failed_blocks.update(load.block_ids[good:])
            self.stats.count("requests_load_failed")
            self.stats.count("blocks_load_failed", total - good)
            log.warning("request %s: %d of %d KV blocks could not be loaded (%s)", load.req_id,
                        total - good, total, outcome.errors)
        else:
            self.stats.count("requests_loaded")
        nbytes = good * self._shards_per_block * self._value_bytes
        self.stats.count("blocks_loaded", good)
        self.stats.count("bytes_loaded", nbytes)
        self.stats.observe("load_seconds", outcome.seconds)
        log.info("request %s: loaded %d KV blocks (%d bytes) from the store in %.1f ms (%s)",
                 load.req_id, good, nbytes, outcome.seconds * 1000,
                 "async" if self.load_async else "in the step")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # whole requests are saved in wait_for_save, all layers at once

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeStoreConnectorMetadata)
        assert self._store is not None and self._mover is not None
        layout = self._mover.layout
        if layout.rank_agnostic and layout.spec.tp_rank != 0:
            return  # MLA pages are identical on every rank: rank 0 stores them once
        if self._sharding is not None and not self._sharding.writes:
            return  # a replica of heads that another rank stores
        for save in meta.saves:
            if not save.block_ids:
                continue
            started = time.perf_counter()
            assert self._io is not None
            result = self._io.store(self._keys(save.block_hashes), save.block_ids)
            if result.failed:
                log.warning("request %s: %d KV blocks could not be stored (%s)", save.req_id,
                            len(result.failed), sorted(set(result.failed.values())))
            self.stats.count("blocks_stored", len(result.stored))
            self.stats.count("blocks_skipped", len(result.skipped))
            self.stats.count("blocks_store_failed", len(result.failed))
            self.stats.count("bytes_stored", len(result.stored) * self._value_bytes)
            self.stats.observe("store_seconds", time.perf_counter() - started)
            log.info("request %s: stored %d KV blocks, %d already in the store", save.req_id,
                     len(result.stored) // self._shards_per_block,
                     len(result.skipped) // self._shards_per_block)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self.stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return TransferStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVConnectorPromMetrics | None:
        return TransferPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._loader is not None:  # loads in flight write into the cache: let them end
            self._loader.shutdown(wait=True, cancel_futures=False)
            self._loader = None
        if self._store is not None:
            self._store.close()
            self._store = None
