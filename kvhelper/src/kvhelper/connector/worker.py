"""The connector's worker side: one per TP rank, in the process that holds the KV cache. It
stores the blocks of finished prompts and loads the blocks the scheduler side asked for, through
`kvhelper.block_io`, and reports failed blocks back to vLLM.

Stores run on a saver thread (`save_async`, the default) while the engine goes on: vLLM keeps a
finished request's blocks until every worker reports its stores ended (`get_finished`), and a
request preempted before its store ended has it finished before the step that may reuse its
blocks runs (`before_forward`). Loads of pages that prefill may still be storing wait for them,
up to `store_wait_seconds`."""

from __future__ import annotations

import concurrent.futures
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch
from vllm.distributed import get_tensor_model_parallel_rank

from kvhelper.block_io import DirectBlockIO, LoadJob, StagedBlockIO, value_keys
from kvhelper.connector.data import (
    LoadOutcome,
    MooncakeStoreConnectorMetadata,
    SaveOutcome,
    Transfer,
)
from kvhelper.connector.lookup import StoreHandshake
from kvhelper.connector.settings import ConnectorSettings
from kvhelper.connector_metrics import TransferStats
from kvhelper.layout import LayoutError, ModelKVSpec, describe_kv_caches
from kvhelper.pages import PageMover
from kvhelper.store import MooncakeConfig, MooncakeKVStore, StoreError
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
        self._released: set[str] = set()  # finished requests whose in-step saves are done
        # One thread each: loads run in order, and so do stores.
        self._loader: ThreadPoolExecutor | None = None
        self._loading: dict[str, Future[LoadOutcome]] = {}
        self._saver: ThreadPoolExecutor | None = None
        # Asynchronous stores by request (a done future where this rank writes nothing), and
        # which of those requests vLLM has finished: reported once all their stores ended.
        self._saving: dict[str, list[Future[SaveOutcome | None]]] = {}
        self._saving_finished: set[str] = set()

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
            if load.asynchronous:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="kvhelper-load")
                self._loading[load.req_id] = self._loader.submit(self._read, load, keys, job,
                                                                 started)
            else:
                self._account(self._read(load, keys, job, started))

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        """Finished requests whose stores are done (vLLM frees their blocks), and requests
        whose asynchronous loads are over, failed blocks included (they are in
        `get_block_ids_with_load_errors`, which vLLM asks right after this, in the same step).
        `finished_req_ids`: the requests vLLM finished since the last step."""
        done = {req_id for req_id, future in self._loading.items() if future.done()}
        for req_id in done:
            self._account(self._loading.pop(req_id).result())
        released, self._released = self._released | self._stores_ended(finished_req_ids), set()
        return released or None, done or None

    def _stores_ended(self, finished_req_ids: set[str]) -> set[str]:
        """Finished requests whose asynchronous stores have all ended, counted and forgotten.
        (A request vLLM has not finished is never reported: it still owns its blocks.)"""
        self._saving_finished |= finished_req_ids & self._saving.keys()
        ended = {req_id for req_id in self._saving_finished
                 if all(future.done() for future in self._saving[req_id])}
        for req_id in ended:
            for future in self._saving.pop(req_id):
                if (outcome := future.result()) is not None:
                    self._account_save(outcome)
        self._saving_finished -= ended
        return ended

    def _read(self, load: Transfer, keys: list[str], job: LoadJob,
              started: float) -> LoadOutcome:
        """Read a request's pages into its blocks (on the loader thread when loads are async),
        once they are all stored when prefill may still be writing them. The time counts from
        `started`, when the load was asked for."""
        waited = self._await_pages(keys, load.wait_seconds) if load.wait_seconds else 0.0
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
                           time.perf_counter() - started, waited)

    def _await_pages(self, keys: list[str], seconds: float) -> float:
        """Wait until the store holds every key, at most `seconds` or until the store cannot
        say (the read then reports what is missing). Returns the seconds waited: 0 when they
        were all there at once."""
        assert self._store is not None
        started = time.monotonic()
        pause, slept = 0.001, False
        while True:
            try:
                if all(self._store.exists(keys, strict=True)):
                    break
            except StoreError:
                break
            if time.monotonic() - started + pause > seconds:
                break
            time.sleep(pause)
            pause, slept = min(pause * 2, 0.02), True
        return time.monotonic() - started if slept else 0.0

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
        if outcome.waited:
            self.stats.observe("store_wait_seconds", outcome.waited)
        log.info("request %s: loaded %d KV blocks (%d bytes) from the store in %.1f ms (%s)%s",
                 load.req_id, good, nbytes, outcome.seconds * 1000,
                 "async" if load.asynchronous else "in the step",
                 f", {outcome.waited * 1000:.1f} ms of it waiting for prefill's store"
                 if outcome.waited else "")

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # -- stores ------------------------------------------------------------------------------

    def before_forward(self, meta: MooncakeStoreConnectorMetadata) -> None:
        """vLLM has freed the blocks of requests it preempted in this step and may write them
        in its forward: their stores must end before it runs."""
        pending = [future for req_id in meta.preempted for future in self._saving.get(req_id, ())]
        if pending:
            concurrent.futures.wait(pending)

    def wait_for_save(self, meta: MooncakeStoreConnectorMetadata) -> None:
        """Store the step's finished prompts (and, with decode saving, finished requests):
        on the saver thread, or here when saves are not asynchronous."""
        assert self._mover is not None
        if not self.settings.save_async:
            # Every rank reports a decode save as done once this step's stores are (a rank
            # that does not store these pages has nothing to wait for): vLLM frees the blocks
            # when every rank has.
            released = {save.req_id for save in meta.saves if save.release}
            try:
                for save in meta.saves:
                    if self._writes() and save.block_ids:
                        self._account_save(self._store_pages(save, None))
            finally:
                self._released |= released
            return
        # A device cache's pages are written by work queued on its stream: the saver thread
        # waits for this step's to finish before it reads them.
        ready = None
        if self._mover.device.type == "cuda":
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
        for save in meta.saves:
            future: Future[SaveOutcome | None]
            if self._writes() and save.block_ids:
                if self._saver is None:
                    self._saver = ThreadPoolExecutor(1, thread_name_prefix="kvhelper-save")
                future = self._saver.submit(self._store_pages, save, ready)
            else:
                future = Future()
                future.set_result(None)
            self._saving.setdefault(save.req_id, []).append(future)
            if save.release:  # decode saving: the request has finished already
                self._saving_finished.add(save.req_id)

    def _writes(self) -> bool:
        """Whether this rank stores pages at all."""
        assert self._mover is not None
        layout = self._mover.layout
        if layout.rank_agnostic and layout.spec.tp_rank != 0:
            return False  # MLA pages are identical on every rank: rank 0 stores them once
        # A replica of heads that another rank stores writes nothing.
        return self._sharding is None or self._sharding.writes

    def _store_pages(self, save: Transfer, ready: torch.cuda.Event | None) -> SaveOutcome:
        """Store one request's blocks (on the saver thread when saves are asynchronous). A
        failure is logged and counted, never raised: the request has been answered."""
        if ready is not None:
            ready.synchronize()
        started = time.perf_counter()
        keys = self._keys(save.block_hashes)
        try:
            result = self._block_io.store(keys, save.block_ids)
            stored, skipped, failed = len(result.stored), len(result.skipped), result.failed
        except Exception as err:
            log.warning("request %s: storing KV pages failed: %s", save.req_id, err)
            stored, skipped, failed = 0, 0, dict.fromkeys(keys, -1)
        return SaveOutcome(save, stored, skipped, failed, time.perf_counter() - started)

    def _account_save(self, outcome: SaveOutcome) -> None:
        """Count a finished store, and log it."""
        save, io = outcome.save, self._block_io
        if outcome.failed:
            log.warning("request %s: %d KV blocks could not be stored (%s)", save.req_id,
                        len(outcome.failed), sorted(set(outcome.failed.values())))
        self.stats.count("blocks_stored", outcome.stored)
        self.stats.count("blocks_skipped", outcome.skipped)
        self.stats.count("blocks_store_failed", len(outcome.failed))
        self.stats.count("bytes_stored", outcome.stored * io.value_bytes)
        self.stats.observe("store_seconds", outcome.seconds)
        if save.release:
            self.stats.count("decode_saves")
            self.stats.count("decode_bytes_stored", outcome.stored * io.value_bytes)
        log.info("request %s: stored %d KV blocks, %d already in the store, in %.1f ms%s",
                 save.req_id, outcome.stored // io.values_per_block,
                 outcome.skipped // io.values_per_block, outcome.seconds * 1000,
                 " (after decode)" if save.release else "")

    def shutdown(self) -> None:
        # Loads in flight write into the cache, and stores read it: let them end.
        for pool in (self._loader, self._saver):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=False)
        self._loader = self._saver = None
        if self._store is not None:
            self._store.close()
            self._store = None
