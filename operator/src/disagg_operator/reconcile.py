"""One reconcile of one DisaggServing: spec → render → apply and prune → observe → status.

The decisions are pure functions (render, `apply_reason`, compute_status); this module only
sequences them around the ClusterApi calls. A resync that finds nothing to change makes no
write call: children are applied only when their desired form changed or they drifted, and the
status is patched only when it differs.
"""

from __future__ import annotations

import copy
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from disagg_operator import metrics
from disagg_operator.association import PROXY, Owner, child_name, name_problem
from disagg_operator.autoscaler import Autoscaler, with_replicas
from disagg_operator.etcd_health import EtcdHealthChecker
from disagg_operator.field_ownership import HANDOVER_MANAGER, replicas_handovers
from disagg_operator.kube import OPTIONAL_KINDS, ApiFailure, ChildKey, ClusterApi
from disagg_operator.missing_secrets import FAILED_MOUNT, missing_secrets, waiting_pods
from disagg_operator.plan import ClusterAddressing, Plan, build_plan
from disagg_operator.quantity import parse_quantity
from disagg_operator.render import Manifest, render
from disagg_operator.spec import InvalidSpecError, parse_spec, spec_warnings
from disagg_operator.status import (
    EventSpec,
    Observation,
    compute_status,
    invalid_spec_status,
    transition_events,
)
from disagg_operator.transfer_health import TransferMonitor

ANNOTATION_APPLIED_HASH = "serving.disagg.dev/applied-hash"


def utcnow() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class ReconcileResult:
    status: dict[str, Any]
    events: list[EventSpec] = field(default_factory=list)
    applied: list[ChildKey] = field(default_factory=list)
    pruned: list[ChildKey] = field(default_factory=list)
    status_written: bool = False
    error: str | None = None
    requeue_after: float = 0.0  # seconds until the next reconcile, unless something changes


def with_applied_hash(manifest: Manifest) -> Manifest:
    """The manifest plus an annotation that fingerprints it, to skip no-op applies."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:20]
    stamped = copy.deepcopy(manifest)
    stamped["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED_HASH] = digest
    return stamped


def apply_reason(desired: Manifest, live: Manifest | None) -> str | None:
    """Why `desired` (stamped) must be applied over `live`, or None when it is in place."""
    if live is None:
        return "missing"
    annotations = live.get("metadata", {}).get("annotations") or {}
    if annotations.get(ANNOTATION_APPLIED_HASH) != \
            desired["metadata"]["annotations"][ANNOTATION_APPLIED_HASH]:
        return "changed"
    drift = first_difference(desired.get("spec", desired.get("data")),
                             live.get("spec", live.get("data")), "spec")
    return f"drifted at {drift}" if drift else None


def first_difference(desired: Any, live: Any, path: str) -> str | None:
    """The first path where `live` does not hold what `desired` says, tolerating what the API
    server adds (defaults, extra keys) or normalizes (empty values omitted, quantities)."""
    if desired in (None, {}, [], "") and live in (None, {}, [], ""):
        return None
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            return path
        for key, value in desired.items():
            found = first_difference(value, live.get(key), f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return path
        for index, (want, have) in enumerate(zip(desired, live, strict=True)):
            found = first_difference(want, have, f"{path}[{index}]")
            if found:
                return found
        return None
    if desired == live:
        return None
    if isinstance(desired, (int, str)) and isinstance(live, (int, str)):
        try:
            if parse_quantity(str(desired)) == parse_quantity(str(live)):
                return None
        except ValueError:
            pass
    return path


@dataclass
class WrittenStatus:
    """What this reconciler last wrote to one object's status, and the statuses that write
    superseded. A snapshot still showing a superseded one is stale (the write has not come
    back through the watch yet): the last write is what the object holds, so it is neither
    written nor announced again."""
    last: dict[str, Any] | None = None
    superseded: list[dict[str, Any]] = field(default_factory=list)
    keep: int = 8

    def current(self, seen: dict[str, Any]) -> dict[str, Any]:
        if self.last is not None and seen in self.superseded:
            return self.last
        return seen

    def wrote(self, seen: dict[str, Any], previous: dict[str, Any],
              status: dict[str, Any]) -> None:
        for old in (seen, previous):
            if old != status and old not in self.superseded:
                self.superseded.append(old)
        self.superseded = self.superseded[-self.keep:]
        self.last = status


class Reconciler:
    def __init__(self, api: ClusterApi, etcd: EtcdHealthChecker, default_image: str,
                 cluster_domain: str = "cluster.local",
                 clock: Callable[[], str] = utcnow, resync_seconds: float = 60.0,
                 not_ready_resync_seconds: float = 10.0,
                 autoscaler: Autoscaler | None = None,
                 operator_namespace: str | None = None,
                 transfer: TransferMonitor | None = None) -> None:
        self.api = api
        self.transfer = transfer  # None: P/D health is not watched (no scrapes)
        self.operator_namespace = operator_namespace
        if autoscaler is None:
            from disagg_operator.metrics_scrape import PodMetricsScraper
            autoscaler = Autoscaler(PodMetricsScraper(), time.monotonic, clock)
        self.autoscaler = autoscaler
        # A Ready DisaggServing is looked at again after resync_seconds; one that is not (an
        # etcd that may come back, pods still starting) sooner.
        self.resync_seconds = resync_seconds
        self.not_ready_resync_seconds = not_ready_resync_seconds
        self.etcd = etcd
        self._written: dict[str, WrittenStatus] = {}
        self.default_image = default_image
        self.cluster_domain = cluster_domain
        self.clock = clock

    def forget(self, uid: str) -> None:
        """The object is gone (or no longer this process's to reconcile)."""
        self._written.pop(uid, None)
        self.autoscaler.forget(uid)
        if self.transfer is not None:
            self.transfer.forget(uid)

    async def reconcile(self, body: Mapping[str, Any]) -> ReconcileResult:
        meta = body["metadata"]
        namespace, name = meta["namespace"], meta["name"]
        started = time.perf_counter()
        try:
            result = await self._reconcile(body)
        finally:
            metrics.RECONCILE_SECONDS.labels(namespace, name).observe(
                time.perf_counter() - started)
        if result.error:
            metrics.RECONCILE_ERRORS.labels(namespace, name, _reason(result.status)).inc()
        metrics.observe_status(namespace, name, result.status)
        return result

    async def _reconcile(self, body: Mapping[str, Any]) -> ReconcileResult:
        meta = body["metadata"]
        owner = Owner(meta["name"], meta["namespace"], meta["uid"])
        generation = int(meta.get("generation") or 1)
        seen = dict(body.get("status") or {})
        written = self._written.setdefault(owner.uid, WrittenStatus())
        previous = written.current(seen)
        try:
            # The API server's CEL rule says the same; re-checked, as every rule is here.
            if problem := name_problem(owner.name):
                raise InvalidSpecError("", problem)
            spec = parse_spec(dict(body.get("spec") or {}))
        except InvalidSpecError as err:
            status = invalid_spec_status(previous, generation, str(err), self.clock())
            result = ReconcileResult(status=status, error=str(err))
            return await self._finish(owner, seen, previous, result)

        apply_error: str | None = None
        error_reason = "ApplyFailed"
        pods: list[Manifest] = []
        try:
            pods = await self.api.list_pods(owner)
        except ApiFailure as err:
            apply_error = f"the API server refused pods: {err.message}"
        # The planner's replica counts, where it sets them, stand in for the spec's.
        scaling = await self.autoscaler.scale(owner.uid, owner.name, spec, pods, previous)
        # The plan is built once; everything below reads it, not the spec.
        plan = build_plan(owner.name, owner.namespace,
                          with_replicas(spec, scaling.replicas if scaling else None),
                          ClusterAddressing(owner.namespace, self.cluster_domain))
        desired = [with_applied_hash(m) for m in render(owner, plan, self.default_image,
                                                          self.operator_namespace)]
        if missing := await self._missing_kinds(desired, owner.namespace):
            message = (f"{', '.join(missing)} is not served by this cluster: instances with "
                       "nodesPerInstance above 1 are LeaderWorkerSet groups; install the "
                       "LeaderWorkerSet controller, or set prefill and decode nodesPerInstance "
                       "to 1")
            status = invalid_spec_status(previous, generation, message, self.clock(),
                                         reason="LeaderWorkerSetMissing")
            return await self._finish(owner, seen, previous,
                                      ReconcileResult(status=status, error=message))
        result = ReconcileResult(status={})
        observed: dict[ChildKey, Manifest] = {}
        target = "children"
        try:
            observed = await self.api.list_children(owner)
            changes = [m for m in desired if apply_reason(
                m, observed.get((m["kind"], m["metadata"]["name"]))) is not None]
            # A child's name taken by an object this DisaggServing does not own: never
            # adopted (its owner's delete would garbage-collect it), named in the status.
            for manifest in changes:
                key = (manifest["kind"], manifest["metadata"]["name"])
                if key not in observed and await self.api.get(
                        key[0], owner.namespace, key[1]) is not None:
                    raise ChildConflict(f"{key[0]} {key[1]} already exists and does not "
                                        f"belong to this DisaggServing: the operator leaves "
                                        "it as it is; delete or rename it (or give the "
                                        "DisaggServing another name), and the operator goes on")
            # The API server validates every change (dry run) before any is made, so a change
            # it refuses (e.g. an immutable StatefulSet field) leaves the children as they were.
            for manifest in changes:
                target = f"{manifest['kind']}/{manifest['metadata']['name']}"
                await self.api.apply(manifest, dry_run=True)
            # A count the operator stops applying is handed over first, never dropped.
            for handover in replicas_handovers(changes, observed):
                target = f"{handover['kind']}/{handover['metadata']['name']}"
                await self.api.apply(handover, field_manager=HANDOVER_MANAGER)
            for manifest in changes:
                key = (manifest["kind"], manifest["metadata"]["name"])
                target = f"{key[0]}/{key[1]}"
                observed[key] = await self.api.apply(manifest)
                result.applied.append(key)
            # Prune only after every desired child is in place, never on a half-applied spec.
            wanted = {(m["kind"], m["metadata"]["name"]) for m in desired}
            for key in sorted(set(observed) - wanted):
                target = f"{key[0]}/{key[1]}"
                await self.api.delete(key[0], owner.namespace, key[1])
                del observed[key]
                result.pruned.append(key)
        except ApiFailure as err:
            apply_error = f"the API server refused {target}: {err.message}"
        except ChildConflict as err:
            apply_error, error_reason = str(err), "Conflict"

        secrets_missing = await self._missing_secrets(owner, plan, pods)
        health = await self.etcd.check(plan.etcd_endpoints, plan.etcd_health_via)
        transfer = (await self.transfer.check(owner.uid, spec, pods)
                    if self.transfer is not None else None)
        observation = Observation(
            generation=generation, desired=desired, observed=observed,
            etcd_mode="Managed" if plan.etcd_managed else "External",
            etcd_endpoints=plan.etcd_endpoints, etcd_health=health,
            endpoint=self._endpoint(owner, plan), apply_error=apply_error,
            apply_error_reason=error_reason, pods=pods,
            roles={child_name(owner.name, c.role): c.role for c in plan.components},
            autoscaling=scaling.status if scaling else None, transfer=transfer,
            missing_secrets=tuple(secrets_missing), warnings=tuple(spec_warnings(spec)))
        result.status = compute_status(observation, previous, self.clock())
        result.error = apply_error
        return await self._finish(owner, seen, previous, result)

    async def _finish(self, owner: Owner, seen: dict[str, Any], previous: dict[str, Any],
                      result: ReconcileResult) -> ReconcileResult:
        if result.status != previous:
            patch = merge_patch(previous, result.status)
            await self.api.patch_status(owner.namespace, owner.name, patch)
            result.status_written = True
            self._written[owner.uid].wrote(seen, previous, result.status)
        result.events = transition_events(previous, result.status)
        ready = any(c.get("type") == "Ready" and c.get("status") == "True"
                    for c in result.status.get("conditions") or [])
        result.requeue_after = self.resync_seconds if ready else self.not_ready_resync_seconds
        planner_due = self.autoscaler.due_in(owner.uid)
        if planner_due is not None:
            result.requeue_after = min(result.requeue_after, planner_due)
        return result

    async def _missing_secrets(self, owner: Owner, plan: Plan,
                               pods: list[Manifest]) -> list[str]:
        """What the kubelet reports missing, read only while some pod has not started."""
        if not waiting_pods(pods):
            return []
        try:
            events = await self.api.list_pod_events(owner.namespace, FAILED_MOUNT)
        except ApiFailure:
            events = []  # the pods' own states still name a missing env Secret
        return missing_secrets(pods, events, plan.secret_fields(), owner.namespace)

    async def _missing_kinds(self, desired: list[Manifest], namespace: str) -> list[str]:
        kinds = sorted({m["kind"] for m in desired} & set(OPTIONAL_KINDS))
        try:
            return [kind for kind in kinds if not await self.api.serves(kind, namespace)]
        except ApiFailure:
            return []  # unknown: the apply below reports what the API server says

    def _endpoint(self, owner: Owner, plan: Plan) -> str:
        host = ClusterAddressing(owner.namespace, self.cluster_domain).service_host(
            child_name(owner.name, PROXY))
        return f"http://{host}:{plan.proxy_port}"


def merge_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that turns `old` into `new`: the API server merges a status patch
    into the stored status, so a key gone from a nested map must be sent as null."""
    patch: dict[str, Any] = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(before, Mapping) and isinstance(value, Mapping):
            patch[key] = merge_patch(before, value)
        else:
            patch[key] = value
    return patch


class ChildConflict(Exception):
    """A child's name is taken by an object that is not this DisaggServing's."""


def _reason(status: Mapping[str, Any]) -> str:
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Ready":
            return str(cond.get("reason") or "Unknown")
    return "Unknown"
