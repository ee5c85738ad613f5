"""MooncakeStoreConnector: a vLLM v1 KV connector that moves whole KV pages through a Mooncake
store, keyed by vLLM's chained block hashes (so equal prefixes share pages) and namespaced by the
layout fingerprint (so incompatible instances never read each other's pages).

Producer (prefill): after the forward pass that completes a prompt, its full blocks are stored,
one value per block (existing keys are skipped), on a saver thread while the engine goes on
(vLLM holds the blocks until the store ends; `save_async: false` stores inside the step);
`request_finished` tells the client, through `kv_transfer_params`, how many tokens decode can
load, and that they may still be on their way (decode waits for them, up to
`store_wait_seconds`). Consumer (decode): for a request carrying
those parameters, the full blocks it does not already hold in its own prefix cache are loaded
into the blocks vLLM allocated after the cached ones; a page that cannot be read is reported per
block so vLLM recomputes or fails, as its `kv_load_failure_policy` says. Loads are asynchronous:
the request waits in vLLM's WAITING_FOR_REMOTE_KVS state while one loader thread reads its
pages, and other requests keep running. `kv_connector_extra_config: {"load_async": false}` reads
them inside the scheduler step instead.

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

This module is the facade vLLM loads (`kv_connector_module_path: kvhelper.connector`): it builds
the side its role needs and hands each call to it. `scheduler` decides what moves, `worker`
moves it, `data` is what they share, `settings` is kv_connector_extra_config parsed once.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvhelper import compat, vllm_cpu_rope
from kvhelper.connector.data import (
    IDENTITY_KEY,
    PARAMS_KEY,
    PREFIX_HASH_KEY,
    MooncakeStoreConnectorMetadata,
)
from kvhelper.connector.lookup import StoreHandshake
from kvhelper.connector.scheduler import SchedulerSide
from kvhelper.connector.settings import ConnectorSettings
from kvhelper.connector.worker import WorkerSide
from kvhelper.connector_metrics import TransferPromMetrics, TransferStats
from kvhelper.store import MooncakeConfig
from kvhelper.stored_prefix import StoredPrefixLookup

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

log = logging.getLogger("vllm.kvhelper.connector")

__all__ = ["IDENTITY_KEY", "PARAMS_KEY", "PREFIX_HASH_KEY", "MooncakeStoreConnector"]


def _loads_exact(vllm_config: VllmConfig) -> bool:
    """Whether a tail computed over loaded blocks gives the whole prompt's answer here, said in
    a log line at start-up. vLLM's CPU build mis-rotates MLA keys unless kvhelper's plugin fixes
    it (`kvhelper.vllm_cpu_rope`); with the fix turned off, this instance loads nothing."""
    if not vllm_config.model_config.use_mla:
        return True
    if vllm_cpu_rope.exact():
        log.info("kvhelper connector: MLA rotary embedding exact on this platform; loaded "
                 "context gives the answers of a whole prompt")
        return True
    log.warning("kvhelper connector: LOADS OFF. vLLM's CPU rotary-embedding kernel "
                "mis-rotates MLA keys (and %s=off keeps kvhelper's fix out), so a prompt's "
                "tail computed over loaded blocks would answer otherwise than the whole prompt: "
                "this instance computes every prompt itself", vllm_cpu_rope.ENV)
    return False


class MooncakeStoreConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self.settings = ConnectorSettings.parse(transfer.kv_connector_extra_config)
        # Refuses unshareable settings at start, on both sides.
        identity = compat.identity(vllm_config, self.settings.store_tp_size)
        self.stats = TransferStats()
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.WORKER:
            self._worker = WorkerSide(vllm_config, self.settings, self.stats)
        else:
            loads_exact = _loads_exact(vllm_config)
            lookup = (StoredPrefixLookup(MooncakeConfig.load(self.settings.raw))
                      if self.settings.store_lookup and transfer.is_kv_producer else None)
            self._scheduler = SchedulerSide(
                int(vllm_config.cache_config.block_size), bool(transfer.is_kv_producer),
                bool(transfer.is_kv_consumer), identity, self.settings.load_async, self.stats,
                lookup, self.settings.lookup_load_async, self.settings.save_decode_cache,
                self.settings.save_async, self.settings.store_wait_seconds, loads_exact)

    @property
    def scheduler(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side call on the worker side"
        return self._scheduler

    @property
    def worker(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side call on the scheduler side"
        return self._worker

    # -- scheduler side ---------------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        """The workers' store layout (every rank's is the same for lookups): keys to ask."""
        handshake = next((m for m in metadata.values() if isinstance(m, StoreHandshake)), None)
        if handshake is not None:
            self.scheduler.set_layout(handshake)

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # The blocks are held while a store of them may still run (asynchronous saves, decode
        # saving) until every worker reports it done.
        return self.scheduler.request_finished(request, block_ids)

    # -- worker side ------------------------------------------------------------------------

    def _metadata(self) -> MooncakeStoreConnectorMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, MooncakeStoreConnectorMetadata)
        return meta

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker.handshake()

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        # Before the step's forward (vLLM starts asynchronous loads only after it).
        if self._worker is not None:
            self._worker.before_forward(self._metadata())

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv(self._metadata())

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # whole requests are saved in wait_for_save, all layers at once

    def wait_for_save(self) -> None:
        self.worker.wait_for_save(self._metadata())

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

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
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()
