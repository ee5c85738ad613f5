"""The connector's worker side: one per TP rank, in the process that holds the KV cache. It
stores the blocks of finished prompts and loads the blocks the scheduler side asked for, through
`kvhelper.block_io`, and reports failed blocks back to vLLM."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from vllm.distributed import get_tensor_model_parallel_rank

from kvhelper.block_io import DirectBlockIO, LoadJob, StagedBlockIO, value_keys
from kvhelper.connector.data import LoadOutcome, MooncakeStoreConnectorMetadata, Transfer
from kvhelper.connector.lookup import StoreHandshake
from kvhelper.connector.settings import ConnectorSettings
from kvhelper.connector_metrics import TransferStats
from kvhelper.layout import LayoutError, ModelKVSpec, describe_kv_caches
from kvhelper.pages import PageMover
from kvhelper.store import MooncakeConfig, MooncakeKVStore
from kvhelper.tp import StoreSharding, store_sharding

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger("vllm.kvhelper.connector")


class WorkerSide:
    def __init__(self, vllm_config: VllmConfig, settings: ConnectorSettings,
                 stats: TransferStats) -> None:
        self._vllm_config = vllm_config
        self.settings = settings
        self.stats = stats
        # Fail at start-up, not at the first request, on missing or contradictory settings.
        self._config = MooncakeConfig.load(settings.raw)
        self._store: MooncakeKVStore | None = None
        self._mover: PageMover | None = None
        self._io: DirectBlockIO | StagedBlockIO | None = None
        self._fingerprint = ""
        self._sharding: StoreSharding | None = None  # None: rank-agnostic (MLA) pages
        self._failed_blocks: set[int] = set()
        self._released: set[str] = set()  # finished requests whose decode save is done
        # One thread: loads run in order.
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future[LoadOutcome]] = {}

    @property
    def _block_io(self) -> DirectBlockIO | StagedBlockIO:
        assert self._io is not None, "register_kv_caches has not run"
        return self._io

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        # The worker's own rank: GQA pages are keyed by it, and only rank 0 stores MLA pages.
        spec = ModelKVSpec.from_vllm_config(self._vllm_config,
                                            tp_rank=get_tensor_model_parallel_rank())
        layout = describe_kv_caches(kv_caches, spec)
        self._mover = PageMover(layout, kv_caches)
        self._fingerprint = layout.fingerprint()
        if not layout.rank_agnostic:
            self._sharding = store_sharding(spec.total_kv_heads, spec.tp_size, spec.tp_rank,
                                            self.settings.store_tp_size)
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
        transfer = self.settings.transfer
        if transfer == "direct" or (transfer == "auto" and self._mover.device.type == "cpu"):
            self._io = DirectBlockIO(self._store, self._mover, heads)
        else:
            self._io = StagedBlockIO(self._store, self._mover, heads,
                                     self.settings.staging_buffer_bytes)
        sharding = self._sharding
        log.info("kvhelper connector ready: %s, fingerprint %s, %s, %s", layout.describe(),
                 self._fingerprint, self._io.describe(),
                 "rank-agnostic pages" if sharding is None else
                 f"store shards {list(sharding.shard_ids)} of {sharding.shards}"
                 + ("" if sharding.writes else " (read only: another rank stores these heads)"))

    def handshake(self) -> StoreHandshake:
        """How this instance's keys are made, for the scheduler side's lookups."""
        assert self._mover is not None, "register_kv_caches has not run"
        return StoreHandshake(self._fingerprint,
                              None if self._sharding is None else self._sharding.shards)

    def _keys(self, hashes: list[str]) -> list[str]:
        return value_keys(self._fingerprint, hashes, self._sharding)

    # -- loads -------------------------------------------------------------------------------

    def start_load_kv(self, meta: MooncakeStoreConnectorMetadata) -> None:
        for load in meta.loads:
            # Keys and addresses here, so that the loader thread needs the GIL as little as
            # possible: vLLM's busy loop holds it, and each hand-over can cost a switch interval.
            started = time.perf_counter()
            keys = self._keys(load.block_hashes)
            job = self._block_io.load_job(keys, load.block_ids)
            if self.settings.load_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvhelper-load")
                self._loading[load.req_id] = self._loader.submit(self._read, load, keys, job,
                                                                 started)
            else:
                self._account(self._read(load, keys, job, started))

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose decode save is done (vLLM frees their blocks), and requests
        whose asynchronous loads are over, failed blocks included (they are in
        `get_block_ids_with_load_errors`, which vLLM asks right after this, in the same step)."""
        done = {req_id for req_id, future in self._loading.items() if future.done()}
        for req_id in done:
            self._account(self._loading.pop(req_id).result())
        released, self._released = self._released, set()
        return released or None, done or None

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
        good = first_failed // self._block_io.values_per_block
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
        io = self._block_io
        nbytes = good * io.values_per_block * io.value_bytes
        self.stats.count("blocks_loaded", good)
        self.stats.count("bytes_loaded", nbytes)
        self.stats.observe("load_seconds", outcome.seconds)
        log.info("request %s: loaded %d KV blocks (%d bytes) from the store in %.1f ms (%s)",
                 load.req_id, good, nbytes, outcome.seconds * 1000,
                 "async" if self.settings.load_async else "in the step")

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- stores ------------------------------------------------------------------------------

    def wait_for_save(self, meta: MooncakeStoreConnectorMetadata) -> None:
        assert self._mover is not None
        # Every rank reports a decode save as done once this step's stores are (a rank that
        # does not store these pages has nothing to wait for): vLLM frees the blocks when
        # every rank has.
        released = {save.req_id for save in meta.saves if save.release}
        try:
            self._store_all(meta)
        finally:
            self._released |= released

    def _store_all(self, meta: MooncakeStoreConnectorMetadata) -> None:
        assert self._mover is not None
        layout = self._mover.layout
        if layout.rank_agnostic and layout.spec.tp_rank != 0:
            return  # MLA pages are identical on every rank: rank 0 stores them once
        if self._sharding is not None and not self._sharding.writes:
            return  # a replica of heads that another rank stores
        io = self._block_io
        for save in meta.saves:
            if not save.block_ids:
                continue
            started = time.perf_counter()
            result = io.store(self._keys(save.block_hashes), save.block_ids)
            if result.failed:
                log.warning("request %s: %d KV blocks could not be stored (%s)", save.req_id,
                            len(result.failed), sorted(set(result.failed.values())))
            self.stats.count("blocks_stored", len(result.stored))
            self.stats.count("blocks_skipped", len(result.skipped))
            self.stats.count("blocks_store_failed", len(result.failed))
            self.stats.count("bytes_stored", len(result.stored) * io.value_bytes)
            self.stats.observe("store_seconds", time.perf_counter() - started)
            if save.release:
                self.stats.count("decode_saves")
                self.stats.count("decode_bytes_stored", len(result.stored) * io.value_bytes)
            log.info("request %s: stored %d KV blocks, %d already in the store%s", save.req_id,
                     len(result.stored) // io.values_per_block,
                     len(result.skipped) // io.values_per_block,
                     " (after decode)" if save.release else "")

    def shutdown(self) -> None:
        if self._loader is not None:  # loads in flight write into the cache: let them end
            self._loader.shutdown(wait=True, cancel_futures=False)
            self._loader = None
        if self._store is not None:
            self._store.close()
            self._store = None
