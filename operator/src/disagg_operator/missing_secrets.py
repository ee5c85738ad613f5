"""Secrets the serving pods wait for, read from what the kubelet reports. Pure.

A pod whose Secret volume is missing stays `ContainerCreating` with no word in its status; the
kubelet says why only in a `FailedMount` Event. A missing Secret (or key) read as an env value
shows as `CreateContainerConfigError` in the container's state. Both are turned into one line
per Secret that names the spec field and the fix, so the DisaggServing's conditions say it.
The operator never reads a Secret itself: it has no RBAC for Secrets.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from disagg_operator.render import Manifest

FAILED_MOUNT = "FailedMount"
_NOT_FOUND = re.compile(r'secrets? "(?P<secret>[^"]+)" not found', re.IGNORECASE)
_NO_KEY = re.compile(r"couldn't find key (?P<key>\S+) in Secret [^/\s]+/(?P<secret>[^\s,]+)")


def waiting_pods(pods: list[Manifest]) -> dict[str, list[str]]:
    """Pods not yet running all their containers, with the kubelet's waiting messages."""
    waiting: dict[str, list[str]] = {}
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        if meta.get("deletionTimestamp"):
            continue
        states = [s.get("state") or {} for s in status.get("containerStatuses") or []]
        started = bool(states) and all("running" in s for s in states)
        if status.get("phase") in ("Running", "Succeeded") and started:
            continue
        waiting[meta.get("name", "?")] = [
            str((s.get("waiting") or {}).get("message") or "") for s in states]
    return waiting


def missing_secrets(pods: list[Manifest], events: list[Manifest],
                    secret_fields: Mapping[str, tuple[str, ...]],
                    namespace: str) -> list[str]:
    """One message per missing Secret or key that keeps a pod from starting; [] when none.
    Events of pods that have since started (the Secret was created) are not counted."""
    waiting = waiting_pods(pods)
    reports: list[tuple[str, str | None, str]] = []  # (secret, missing key, pod)
    for event in events:
        involved = event.get("involvedObject") or {}
        if event.get("reason") != FAILED_MOUNT or involved.get("kind") != "Pod":
            continue
        if (pod := involved.get("name")) in waiting:
            for match in _NOT_FOUND.finditer(str(event.get("message") or "")):
                reports.append((match["secret"], None, pod))
    for pod, messages in waiting.items():
        for message in messages:
            reports += [(m["secret"], None, pod) for m in _NOT_FOUND.finditer(message)]
            reports += [(m["secret"], m["key"], pod) for m in _NO_KEY.finditer(message)]
    pods_by_problem: dict[tuple[str, str | None], list[str]] = {}
    for secret, key, pod in reports:
        found = pods_by_problem.setdefault((secret, key), [])
        if pod not in found:
            found.append(pod)
    return [_message(secret, key, sorted(waiting_pods), secret_fields.get(secret, ()),
                     namespace) for (secret, key), waiting_pods in pods_by_problem.items()]


def _message(secret: str, key: str | None, pods: list[str], fields: tuple[str, ...],
             namespace: str) -> str:
    named = f" (named by {', '.join(fields)})" if fields else ""
    waiting = f"; pods waiting for it: {', '.join(pods[:3])}" + (
        f" and {len(pods) - 3} more" if len(pods) > 3 else "")
    if key is not None:
        return (f"Secret {secret}{named} has no key {key}: add the key to the Secret, or set "
                f"the field's key to one it has{waiting}")
    return (f"Secret {secret}{named} does not exist in namespace {namespace}: create it "
            f"(kubectl -n {namespace} create secret ...) or name an existing one{waiting}")
