"""kopf handlers: thin glue between kopf's watches and the Reconciler.

One daemon per DisaggServing runs its reconcile loop. It wakes on a change of the object's
spec, on any event of a child it owns (a Deployment becoming ready, a Service deleted by hand),
and on a resync timer; bursts of wakes are coalesced into one reconcile.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import kopf
from lightkube import AsyncClient
from prometheus_client import start_http_server

from disagg_operator import metrics
from disagg_operator.association import LABEL_MANAGED_BY, MANAGED_BY
from disagg_operator.autoscaler import SAMPLE_SECONDS, Autoscaler
from disagg_operator.child_kinds import CHILD_KINDS
from disagg_operator.etcd_health import EtcdHealthChecker
from disagg_operator.kube import ApiFailure, LightkubeApi, LightkubeLeaseStore
from disagg_operator.leader import ElectionSettings, LeaderElector
from disagg_operator.metrics_scrape import PodMetricsScraper
from disagg_operator.reconcile import Reconciler, utcnow
from disagg_operator.spec import GROUP, KIND, PLURAL, VERSION
from disagg_operator.transfer_health import TransferMonitor

FINALIZER = f"{GROUP}/finalizer"
registry = kopf.OperatorRegistry()


@dataclass(frozen=True)
class OperatorConfig:
    default_image: str
    resync_seconds: float = 60.0
    not_ready_resync_seconds: float = 10.0  # e.g. to notice an etcd that came back
    debounce_seconds: float = 0.1
    error_backoff_seconds: tuple[float, ...] = (1.0, 2.0, 5.0, 10.0, 30.0)
    cluster_domain: str = "cluster.local"
    etcd_address_overrides: Mapping[str, str] = field(default_factory=dict)
    etcd_health_ttl_seconds: float = 10.0
    etcd_tls_dir: Path | None = None  # the operator's own etcd client certificate
    metrics_port: int | None = None
    # Pod host:port -> host:port for the planner's metrics scrapes (tests: loopback servers).
    metrics_address_overrides: Mapping[str, str] = field(default_factory=dict)
    # How often the planner samples the engines between its decisions.
    planner_sample_seconds: float = SAMPLE_SECONDS
    # The interval over which the Degraded condition judges whether P/D really happens
    # (disagg_operator.transfer_health); None: not watched.
    transfer_window_seconds: float | None = 60.0
    operator_namespace: str | None = None  # where its pod runs; None: outside the cluster
    # With several replicas: only the holder of the Lease `lease_name` in `lease_namespace`
    # reconciles; one that loses it sets `lease_lost` and `stop_flag` (kopf's) and exits, to
    # restart as standby.
    leader_election: ElectionSettings | None = None
    lease_namespace: str = "default"
    lease_name: str = "disagg-operator"
    # An asyncio flag, set in kopf's loop: kopf waits for a threading one in an executor
    # thread, which kept the process from exiting on any stop it did not set (SIGTERM, a
    # failed start-up) until the grace period's SIGKILL.
    stop_flag: asyncio.Event | None = None
    lease_lost: threading.Event | None = None


class WakeBoard:
    """One wake-up event per DisaggServing uid, set by watch handlers, awaited by its daemon."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        self.reconciled_generation: dict[str, int] = {}

    def event(self, uid: str) -> asyncio.Event:
        return self._events.setdefault(uid, asyncio.Event())

    def wake(self, uid: str) -> None:
        if uid in self._events:
            self._events[uid].set()

    def forget(self, uid: str) -> None:
        self._events.pop(uid, None)
        self.reconciled_generation.pop(uid, None)


@dataclass
class OperatorContext:
    config: OperatorConfig
    client: AsyncClient
    reconciler: Reconciler
    wakeboard: WakeBoard
    leading: asyncio.Event  # set while this replica may reconcile
    elector: LeaderElector | None = None
    election: asyncio.Task[None] | None = None


@kopf.on.login(registry=registry)
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    """In a pod: the service account. Elsewhere: $KUBECONFIG or ~/.kube/config."""
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.startup(registry=registry)
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.config
    if config.metrics_port is not None:
        # First, before any Lease is taken: a replica that cannot start must not lead.
        try:
            start_http_server(config.metrics_port)
        except OSError as err:
            raise kopf.PermanentError(f"--metrics-port {config.metrics_port}: {err}; choose "
                                      "another port, or 0 to turn metrics off") from None
    settings.persistence.finalizer = FINALIZER
    settings.posting.loggers = False  # only the Events we post on purpose, not log lines
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 60
    client = AsyncClient()
    wakeboard = WakeBoard()
    reconciler = Reconciler(
        LightkubeApi(client),
        EtcdHealthChecker(ttl=config.etcd_health_ttl_seconds,
                          address_overrides=config.etcd_address_overrides,
                          tls_dir=config.etcd_tls_dir),
        default_image=config.default_image, cluster_domain=config.cluster_domain,
        resync_seconds=config.resync_seconds,
        not_ready_resync_seconds=config.not_ready_resync_seconds,
        operator_namespace=config.operator_namespace,
        autoscaler=Autoscaler(
            PodMetricsScraper(address_overrides=config.metrics_address_overrides),
            time.monotonic, utcnow, sample_seconds=config.planner_sample_seconds,
            wake=wakeboard.wake),
        transfer=None if config.transfer_window_seconds is None else TransferMonitor(
            PodMetricsScraper(address_overrides=config.metrics_address_overrides),
            config.transfer_window_seconds))
    if config.leader_election is None:
        leading = asyncio.Event()
        leading.set()
        memo.context = OperatorContext(config, client, reconciler, wakeboard, leading)
    else:
        elector = LeaderElector(
            LightkubeLeaseStore(client, config.lease_namespace, config.lease_name),
            config.leader_election)
        memo.context = OperatorContext(config, client, reconciler, wakeboard, elector.leading,
                                       elector, asyncio.create_task(_lead(elector, config)))


async def _lead(elector: LeaderElector, config: OperatorConfig) -> None:
    """Lead until the lease is lost; then stop the whole operator (its pod restarts it as a
    standby), as client-go's controllers do: a replica that might not lead must not write."""
    await elector.run()
    if config.lease_lost is not None:
        config.lease_lost.set()
    if config.stop_flag is not None:
        config.stop_flag.set()


@kopf.on.cleanup(registry=registry)
async def stop(memo: kopf.Memo, **_: Any) -> None:
    config: OperatorConfig = memo.config
    if config.stop_flag is not None:
        # kopf's waiter on the flag is a task it would otherwise wait 5 s for as "hung".
        config.stop_flag.set()
    context: OperatorContext | None = getattr(memo, "context", None)
    if context is not None:
        if context.election is not None:
            context.election.cancel()
        if context.elector is not None:
            await context.elector.release()
        await context.client.close()


@kopf.daemon(GROUP, VERSION, PLURAL, registry=registry, cancellation_timeout=10.0)
async def reconcile_loop(body: kopf.Body, uid: str, namespace: str | None, name: str,
                         memo: Any, stopped: kopf.DaemonStopped,
                         logger: logging.Logger | logging.LoggerAdapter[Any],
                         **_: Any) -> None:
    context: OperatorContext = memo.context
    config = context.config
    wake = context.wakeboard.event(uid)
    failures = 0
    try:
        while not stopped:
            if not context.leading.is_set():  # a standby reconciles nothing
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(context.leading.wait(), timeout=1.0)
                continue
            wake.clear()
            snapshot = copy.deepcopy(dict(body))  # the live body changes under our feet
            if snapshot["metadata"].get("deletionTimestamp"):
                return  # children go with it through their ownerReferences
            try:
                result = await context.reconciler.reconcile(snapshot)
            except ApiFailure as err:
                failures += 1
                delay = config.error_backoff_seconds[
                    min(failures, len(config.error_backoff_seconds)) - 1]
                logger.warning("Reconcile failed (%s); retrying in %gs", err, delay)
            else:
                failures = 0
                context.wakeboard.reconciled_generation[uid] = int(
                    snapshot["metadata"].get("generation") or 1)
                for event in result.events:
                    kopf.event(body, type=event.type, reason=event.reason,
                               message=event.message)
                if result.applied or result.pruned:
                    logger.info("Applied %s; pruned %s", _names(result.applied),
                                _names(result.pruned))
                delay = result.requeue_after
            try:
                await asyncio.wait_for(wake.wait(), timeout=delay)
                await asyncio.sleep(config.debounce_seconds)  # coalesce a burst of events
            except TimeoutError:
                pass
    finally:
        context.wakeboard.forget(uid)
        context.reconciler.forget(uid)
        metrics.forget(namespace or "", name)


@kopf.on.event(GROUP, VERSION, PLURAL, registry=registry)
async def disaggserving_changed(body: kopf.Body, uid: str, memo: kopf.Memo,
                                **_: Any) -> None:
    board: WakeBoard = memo.context.wakeboard
    generation = int(body.get("metadata", {}).get("generation") or 1)
    # Our own status writes come back as events too; only a new generation needs work.
    if board.reconciled_generation.get(uid) != generation:
        board.wake(uid)


async def child_changed(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    board: WakeBoard = memo.context.wakeboard
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            board.wake(ref["uid"])


# Any event of an object it owns wakes its DisaggServing: one watch per child kind.
for _child in CHILD_KINDS:
    kopf.on.event(_child.group, _child.version, _child.plural,
                  labels={LABEL_MANAGED_BY: MANAGED_BY}, registry=registry)(child_changed)


def _names(keys: list[tuple[str, str]]) -> str:
    return ", ".join(f"{kind}/{name}" for kind, name in keys) or "nothing"
