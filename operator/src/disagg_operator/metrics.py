"""Prometheus metrics of the operator, served on --metrics-port."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILE_SECONDS = Histogram(
    "disagg_operator_reconcile_duration_seconds",
    "Time spent reconciling one DisaggServing (operator time, API calls included).",
    ["namespace", "name"],
    buckets=(0.002, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5,
             5.0, 10.0),
)
RECONCILE_ERRORS = Counter(
    "disagg_operator_reconcile_errors_total",
    "Reconciles of one DisaggServing that ended in an error (API refusal or invalid spec).",
    ["namespace", "name", "reason"],
)
API_WRITES = Counter(
    "disagg_operator_api_writes_total",
    "Write calls the operator made to the Kubernetes API.",
    ["verb", "kind"],
)

INSTANCES = Gauge(
    "disagg_operator_instances",
    "Instances of one DisaggServing's role: desired, and ready (as its status shows them).",
    ["namespace", "name", "role", "state"],
)


def observe_status(namespace: str, name: str, status: dict[str, object]) -> None:
    for role in ("prefill", "decode", "proxy"):
        counts = status.get(role)
        if isinstance(counts, dict):
            INSTANCES.labels(namespace, name, role, "desired").set(counts.get("replicas", 0))
            INSTANCES.labels(namespace, name, role, "ready").set(counts.get("readyReplicas", 0))


def forget(namespace: str, name: str) -> None:
    """Drop the per-object series of a deleted DisaggServing, so series do not grow forever."""
    for metric in (RECONCILE_SECONDS,):
        try:
            metric.remove(namespace, name)
        except KeyError:
            pass
    for family in (RECONCILE_ERRORS, INSTANCES):
        for labels in list(family._metrics):  # noqa: SLF001 - no public per-prefix removal
            if labels[:2] == (namespace, name):
                family.remove(*labels)
