"""The kinds of object a DisaggServing's children are: the one list that the API access
(kube), the watches (handlers), the emulator's sandbox and the test of the chart's RBAC read.
Pure: no client library."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChildKind:
    kind: str
    group: str  # "" for the core API
    version: str
    plural: str
    optional: bool = False  # served only where an add-on's CRD is installed


CHILD_KINDS: tuple[ChildKind, ...] = (
    ChildKind("ConfigMap", "", "v1", "configmaps"),
    ChildKind("Service", "", "v1", "services"),
    ChildKind("Deployment", "apps", "v1", "deployments"),
    ChildKind("StatefulSet", "apps", "v1", "statefulsets"),
    ChildKind("NetworkPolicy", "networking.k8s.io", "v1", "networkpolicies"),
    ChildKind("PodDisruptionBudget", "policy", "v1", "poddisruptionbudgets"),
    # Instances spanning nodes (nodesPerInstance > 1), where the LeaderWorkerSet CRD is.
    ChildKind("LeaderWorkerSet", "leaderworkerset.x-k8s.io", "v1", "leaderworkersets",
              optional=True),
)
# What the operator does to its children: server-side apply creates through PATCH.
CHILD_VERBS = ("get", "list", "watch", "create", "patch", "delete")
