"""Status: observed children (and etcd health) into the DisaggServing's status. Pure.

Conditions follow the Kubernetes API conventions: `type`, `status`, `reason`, `message`,
`observedGeneration`, `lastTransitionTime`; the time only moves when `status` changes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from disagg_operator.association import LABEL_COMPONENT, LABEL_INSTANCE
from disagg_operator.etcd_health import EtcdHealth
from disagg_operator.plan import ANNOTATION_COMPAT, Role
from disagg_operator.render import LWS_WORKER_INDEX_LABEL, Manifest
from disagg_operator.spec import SpecWarning
from disagg_operator.transfer_health import TransferHealth

READY = "Ready"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
# Abnormal-true, like Degraded: the spec is valid, but leaves something unchecked.
CONFIG_WARNING = "ConfigWarning"
WORKLOAD_KINDS = ("Deployment", "StatefulSet", "LeaderWorkerSet")
# Workloads whose status has no observedGeneration (its controller does not report one).
WITHOUT_OBSERVED_GENERATION = ("LeaderWorkerSet",)
# The roles a client request needs; each must have at least one ready instance.
SERVING_ROLES = (Role.PREFILL, Role.DECODE, Role.PROXY)
# Ready=False reasons announced by a Warning event of their own (not a second "Degraded").
WARNED_REASONS = ("InvalidSpec", "ApplyFailed", "EtcdUnhealthy", "LeaderWorkerSetMissing",
                  "SecretMissing")


@dataclass(frozen=True)
class WorkloadState:
    role: str
    desired: int
    ready: int
    updated: int
    rolled_out: bool  # the workload controller has seen the latest spec and finished
    failure: str | None  # why the workload controller reports it stuck, if it does

    @property
    def summary(self) -> str:
        """Ready of desired; pods of an old revision still ready during a rollout apart."""
        extra = self.ready - self.desired
        return f"{min(self.ready, self.desired)}/{self.desired}" + (
            f" (+{extra} from the previous rollout)" if extra > 0 else "")

    @property
    def counts(self) -> str:
        return f"{self.role}: {min(self.ready, self.desired)} of {self.desired} ready"

    @property
    def is_ready(self) -> bool:
        return self.rolled_out and self.ready >= self.desired


@dataclass(frozen=True)
class Observation:
    """Everything the status step needs, gathered by the reconciler."""

    generation: int
    desired: list[Manifest]
    observed: dict[tuple[str, str], Manifest]  # (kind, name) -> live object
    etcd_mode: str
    etcd_endpoints: tuple[str, ...]
    etcd_health: EtcdHealth | None
    endpoint: str
    roles: Mapping[str, str]  # workload name -> the plan's role for it
    apply_error: str | None = None
    apply_error_reason: str = "ApplyFailed"  # or Conflict: a child's name is taken
    pods: list[Manifest] = field(default_factory=list)  # the serving pods, as listed
    # status.autoscaling as the autoscaler decided it (None: autoscaling is off); the
    # instance counts are filled in here from the workloads.
    autoscaling: Mapping[str, Any] | None = None
    # Whether P/D really happens (disagg_operator.transfer_health); None: not known.
    transfer: TransferHealth | None = None
    # Secrets (or keys) that keep pods from starting (disagg_operator.missing_secrets).
    missing_secrets: tuple[str, ...] = ()
    warnings: tuple[SpecWarning, ...] = ()  # spec_warnings(spec)


# How much of a crashed container's termination message (its log's end) a condition quotes.
MESSAGE_LINES = 3
MESSAGE_PODS = 3


def pod_failures(pods: list[Manifest]) -> list[str]:
    """Containers that keep failing (restarted after a non-zero exit), with the end of what
    they printed: e.g. a vLLM instance whose connector refused its configuration at start."""
    found = []
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        for status in (pod.get("status") or {}).get("containerStatuses") or []:
            last = ((status.get("lastState") or {}).get("terminated") or
                    (status.get("state") or {}).get("terminated") or {})
            if not status.get("restartCount") or not last.get("exitCode"):
                continue
            lines = [line for line in str(last.get("message") or "").splitlines() if line]
            tail = " | ".join(lines[-MESSAGE_LINES:]) or last.get("reason") or "no message"
            found.append(f"pod {name} container {status.get('name')} exited with code "
                         f"{last['exitCode']} ({status['restartCount']} restarts): {tail}")
    return found[:MESSAGE_PODS]


def kv_rollout(desired: list[Manifest], roles: Mapping[str, str],
               pods: list[Manifest]) -> str | None:
    """Old and new instances per vLLM role while a change of the KV compatibility (model,
    block size, image...) rolls out, told apart by the pods' compatibility annotation; None
    when every vLLM pod runs the desired one."""
    wanted: dict[str, str] = {}
    for workload in desired:
        role = roles.get(workload["metadata"]["name"])
        if workload["kind"] in WORKLOAD_KINDS and role in (Role.PREFILL, Role.DECODE):
            template = _pod_template_of(workload)
            wanted[str(role)] = ((template.get("metadata") or {}).get("annotations")
                                 or {}).get(ANNOTATION_COMPAT, "")
    counts = {role: {"new": 0, "ready": 0, "old": 0} for role in wanted}
    for pod in pods:
        meta = pod.get("metadata") or {}
        role = (meta.get("labels") or {}).get(LABEL_COMPONENT)
        if role not in counts:
            continue
        compat = (meta.get("annotations") or {}).get(ANNOTATION_COMPAT)
        if compat is None or (meta.get("labels") or {}).get(LWS_WORKER_INDEX_LABEL, "0") != "0":
            continue  # not an instance's pod, or a multi-node instance's other node
        if compat != wanted[role]:
            counts[role]["old"] += 1
        elif not meta.get("deletionTimestamp"):
            counts[role]["new"] += 1
            counts[role]["ready"] += _pod_ready(pod)
    if not any(c["old"] for c in counts.values()):
        return None
    return ("new KV compatibility rolling out beside the old (the proxy pairs only equal "
            "ones): " + "; ".join(f"{role} {c['new']} new ({c['ready']} ready), {c['old']} old"
                                  for role, c in counts.items()))


def _pod_template_of(workload: Manifest) -> Manifest:
    spec = workload.get("spec") or {}
    if workload["kind"] == "LeaderWorkerSet":
        return dict((spec.get("leaderWorkerTemplate") or {}).get("leaderTemplate") or {})
    return dict(spec.get("template") or {})


def _pod_ready(pod: Manifest) -> int:
    return int(any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (pod.get("status") or {}).get("conditions") or []))


def workload_state(role: str, desired: Manifest, live: Manifest | None) -> WorkloadState:
    # A workload scaled externally has no replicas in its manifest: what it has is desired.
    replicas = int(desired["spec"].get(
        "replicas", ((live or {}).get("spec") or {}).get("replicas", 1)))
    if live is None:
        return WorkloadState(role, replicas, 0, 0, rolled_out=False, failure=None)
    status = live.get("status") or {}
    generation = live.get("metadata", {}).get("generation")
    observed_generation = status.get("observedGeneration")
    seen_latest = generation is None or (observed_generation or 0) >= generation or (
        observed_generation is None and live.get("kind") in WITHOUT_OBSERVED_GENERATION)
    ready = int(status.get("readyReplicas") or 0)
    updated = int(status.get("updatedReplicas") or 0)
    total = int(status.get("replicas") or 0)
    rolled_out = seen_latest and updated >= replicas and total <= replicas
    failure = None
    for cond in status.get("conditions") or []:
        if cond.get("type") == "Progressing" and cond.get("reason") == "ProgressDeadlineExceeded":
            failure = cond.get("message") or "progress deadline exceeded"
        if cond.get("type") == "ReplicaFailure" and cond.get("status") == "True":
            failure = cond.get("message") or "replica failure"
    return WorkloadState(role, replicas, min(ready, replicas) if rolled_out else ready,
                         updated, rolled_out, failure)


def compute_status(obs: Observation, previous: dict[str, Any], now: str) -> dict[str, Any]:
    """The full status to store; `previous` supplies lastTransitionTime continuity."""
    workloads = [workload_state(obs.roles[d["metadata"]["name"]], d,
                                obs.observed.get((d["kind"], d["metadata"]["name"])))
                 for d in obs.desired if d["kind"] in WORKLOAD_KINDS]
    by_role = {w.role: w for w in workloads}
    selectors = {obs.roles[d["metadata"]["name"]]: pod_selector(d)
                 for d in obs.desired if d["kind"] in WORKLOAD_KINDS}
    status: dict[str, Any] = {"observedGeneration": obs.generation}
    for role in SERVING_ROLES:
        state = by_role.get(role)
        if state is not None:
            status[role] = {"replicas": state.desired, "readyReplicas": state.ready,
                            "summary": state.summary, "selector": ",".join(
                                f"{k}={v}" for k, v in sorted(selectors[role].items()))}
    status["endpoint"] = obs.endpoint
    if obs.autoscaling is not None:
        status["autoscaling"] = autoscaling_status(obs.autoscaling, by_role)
    status["etcd"] = {"mode": obs.etcd_mode, "endpoints": list(obs.etcd_endpoints),
                      "healthy": bool(obs.etcd_health and obs.etcd_health.healthy),
                      "message": obs.etcd_health.message if obs.etcd_health else "not checked"}

    # Ready means requests can be served: every component has a ready instance (old pods
    # serving through a rollout count). Progress is Progressing's; lost capacity is Degraded's.
    not_ready = [w for w in workloads if not w.is_ready]
    no_instance = [w for w in workloads if w.ready < 1]
    short = [w for w in not_ready if w.rolled_out]  # finished rolling, yet below desired
    rolling = [w for w in workloads if not w.rolled_out and w.failure is None]
    failing = [w for w in workloads if w.failure]
    zero = [r for r in SERVING_ROLES if r in by_role and by_role[r].desired == 0]
    etcd_ok = obs.etcd_health is not None and obs.etcd_health.healthy

    if obs.apply_error:
        ready = ("False", obs.apply_error_reason, obs.apply_error)
    elif zero:
        ready = ("False", "ScaledToZero",
                 f"{', '.join(zero)} has 0 replicas: scale it up to serve requests")
    elif no_instance and obs.missing_secrets:
        ready = ("False", "SecretMissing", "; ".join(obs.missing_secrets))
    elif no_instance:
        ready = ("False", "ComponentsNotReady", "no ready instance yet: " + "; ".join(
            w.counts for w in no_instance))
    elif not etcd_ok:
        ready = ("False", "EtcdUnhealthy", _etcd_message(obs))
    elif not_ready:
        ready = ("True", "Serving", f"serving at {obs.endpoint}; " + "; ".join(
            w.counts for w in not_ready))
    else:
        ready = ("True", "AllComponentsReady",
                 f"{len(workloads)} components ready; serving at {obs.endpoint}")

    if obs.missing_secrets:
        progressing = ("False", "SecretMissing", "pods cannot start until it exists: " +
                       "; ".join(obs.missing_secrets))
    elif kv_change := kv_rollout(obs.desired, obs.roles, obs.pods):
        progressing = ("True", "KVRollout", kv_change)
    elif rolling:
        progressing = ("True", "RollingOut", "rolling out " + "; ".join(
            f"{w.role}: {w.updated} of {w.desired} updated, {w.ready} ready" for w in rolling))
    else:
        progressing = ("False", "RolloutComplete", "all components run the latest spec")

    if obs.apply_error:
        degraded = ("True", obs.apply_error_reason, obs.apply_error)
    elif obs.missing_secrets:
        degraded = ("True", "SecretMissing", "; ".join(obs.missing_secrets))
    elif failing:
        degraded = ("True", "WorkloadFailing", "; ".join(f"{w.role}: {w.failure}"
                                                        for w in failing))
    elif crashing := pod_failures(obs.pods):
        degraded = ("True", "InstancesFailing", "; ".join(crashing))
    elif obs.etcd_health is not None and not obs.etcd_health.healthy and not rolling:
        degraded = ("True", "EtcdUnhealthy", _etcd_message(obs))
    elif short:
        degraded = ("True", "ReducedCapacity", "; ".join(w.counts for w in short))
    elif obs.transfer is not None and not obs.transfer.healthy:
        degraded = ("True", obs.transfer.reason, obs.transfer.message)
    else:
        degraded = ("False", "AsExpected", "no component reports a failure")

    if obs.warnings:
        warning = ("True", obs.warnings[0].reason, "; ".join(w.message for w in obs.warnings))
    else:
        warning = ("False", "NoWarnings", "the spec leaves nothing unchecked")
    status["conditions"] = merge_conditions(previous.get("conditions") or [], [
        (READY, *ready), (PROGRESSING, *progressing), (DEGRADED, *degraded),
        (CONFIG_WARNING, *warning)], obs.generation, now)
    return status


def pod_selector(workload: Manifest) -> dict[str, str]:
    """The labels that select a workload's pods (a LeaderWorkerSet has no selector field;
    its pods carry the same instance and component labels)."""
    selector = (workload["spec"].get("selector") or {}).get("matchLabels")
    if selector:
        return dict(selector)
    labels = workload["metadata"]["labels"]
    return {key: labels[key] for key in (LABEL_INSTANCE, LABEL_COMPONENT)}


def autoscaling_status(decided: Mapping[str, Any],
                       workloads: Mapping[str, WorkloadState]) -> dict[str, Any]:
    """The autoscaler's section with each role's instances now (ready) and, where an external
    scaler sets them, the count it asked for."""
    section = dict(decided)
    for role in (Role.PREFILL, Role.DECODE):
        state = workloads.get(role)
        if state is None:
            continue
        entry = dict(section.get(role) or {})
        entry.setdefault("desired", state.desired)
        entry["current"] = state.ready
        section[role] = entry
    return section


def invalid_spec_status(previous: dict[str, Any], generation: int, message: str,
                        now: str, reason: str = "InvalidSpec") -> dict[str, Any]:
    """Keep what was observed before; mark the spec (or what the cluster lacks for it, in
    `reason`) as the reason nothing changes."""
    status = {k: v for k, v in previous.items() if k != "conditions"}
    status["observedGeneration"] = generation
    status["conditions"] = merge_conditions(previous.get("conditions") or [], [
        (READY, "False", reason, message),
        (PROGRESSING, "False", reason, "nothing is applied until this is fixed"),
        (DEGRADED, "True", reason, message),
    ], generation, now)
    return status


def _etcd_message(obs: Observation) -> str:
    detail = obs.etcd_health.message if obs.etcd_health else "not checked yet"
    where = ", ".join(obs.etcd_endpoints)
    return f"etcd ({obs.etcd_mode.lower()}, {where}) is not healthy: {detail}"


def merge_conditions(previous: list[dict[str, Any]],
                     updates: list[tuple[str, str, str, str]],
                     generation: int, now: str) -> list[dict[str, Any]]:
    old = {c.get("type"): c for c in previous}
    merged: list[dict[str, Any]] = []
    for ctype, cstatus, reason, message in updates:
        before = old.get(ctype)
        changed = before is None or before.get("status") != cstatus
        merged.append({
            "type": ctype, "status": cstatus, "reason": reason, "message": message,
            "observedGeneration": generation,
            "lastTransitionTime": (now if changed or before is None
                                   else before.get("lastTransitionTime", now)),
        })
    known = {u[0] for u in updates}
    merged.extend(c for c in previous if c.get("type") not in known)
    return merged


def condition(status: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or []:
        if cond.get("type") == ctype:
            return dict(cond)
    return None


def planner_changes(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """The roles whose planner decision changed between two statuses: (was, now)."""
    before, after = old.get("autoscaling") or {}, new.get("autoscaling") or {}
    if after.get("mode") != "Planner":
        return {}
    changes = {}
    for role in (Role.PREFILL, Role.DECODE):
        was = (before.get(role) or {}).get("desired")
        now = (after.get(role) or {}).get("desired")
        if was is not None and now is not None and was != now:
            changes[str(role)] = (was, now)
    return changes


@dataclass(frozen=True)
class EventSpec:
    type: str  # Normal or Warning
    reason: str
    message: str


def transition_events(old: dict[str, Any], new: dict[str, Any]) -> list[EventSpec]:
    """Events for the important transitions between two statuses."""
    events: list[EventSpec] = []
    before, after = condition(old, READY), condition(new, READY)
    if after is not None and (before is None or (before["status"], before["reason"])
                              != (after["status"], after["reason"])):
        if after["status"] == "True":
            if before is None or before["status"] != "True":  # not for Serving <-> All...
                events.append(EventSpec("Normal", "Ready", after["message"]))
        elif after["reason"] in WARNED_REASONS:
            events.append(EventSpec("Warning", after["reason"], after["message"]))
        elif before is not None and before["status"] == "True":
            events.append(EventSpec("Warning", "NotReady", after["message"]))
    autoscaled = planner_changes(old, new)
    for role, (before_count, after_count) in autoscaled.items():
        events.append(EventSpec("Normal", "Autoscaled", f"planner: {role} {before_count} -> "
                                f"{after_count}: {new['autoscaling'].get('reason')}"))
    for role in SERVING_ROLES:
        was = (old.get(role) or {}).get("replicas")
        now = (new.get(role) or {}).get("replicas")
        if was is not None and now is not None and was != now and role not in autoscaled:
            events.append(EventSpec("Normal", "Scaled", f"{role} scaled from {was} to {now}"))
    ignored = (new.get("autoscaling") or {}).get("specIgnored")
    if ignored and ignored != (old.get("autoscaling") or {}).get("specIgnored"):
        events.append(EventSpec("Warning", "ScaleIgnored", ignored))
    warn_before, warn_after = condition(old, CONFIG_WARNING), condition(new, CONFIG_WARNING)
    if warn_after and warn_after["status"] == "True" and (
            warn_before is None or (warn_before["status"], warn_before["reason"]) !=
            ("True", warn_after["reason"])):
        events.append(EventSpec("Warning", warn_after["reason"], warn_after["message"]))
    deg_before, deg_after = condition(old, DEGRADED), condition(new, DEGRADED)
    # Not twice: a Degraded reason that Ready=False already announced has had its event.
    announced = after is not None and after["status"] == "False" and \
        after["reason"] in WARNED_REASONS
    if deg_after and deg_after["status"] == "True" and not (
            announced and deg_after["reason"] == (after or {}).get("reason")) and (
            deg_before is None or deg_before["status"] != "True"):
        events.append(EventSpec("Warning", "Degraded", deg_after["message"]))
    return events
