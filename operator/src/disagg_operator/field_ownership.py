"""Which field manager owns what in a child object (its `metadata.managedFields`), and the
server-side applies that hand a field over before the operator stops applying it.

Server-side apply removes a field that its only manager stops naming. When a role's replicas
go to an external scaler (`autoscaling.mode: External`) the operator stops applying
`spec.replicas`, and a Deployment at 3 would fall to its default of 1. So first the live count is
applied under a second manager of the operator's (`HANDOVER_MANAGER`), which keeps the field
when the operator lets go; the scaler's first write through /scale then takes it over."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from disagg_operator.render import Manifest

FIELD_MANAGER = "disagg-operator"
HANDOVER_MANAGER = "disagg-operator-handover"
SCALED_KINDS = ("Deployment", "LeaderWorkerSet")


def owns(obj: Mapping[str, Any], manager: str, path: tuple[str, ...]) -> bool:
    """Whether `manager` owns the field at `path` of `obj` (FieldsV1 in managedFields)."""
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") != manager:
            continue
        node: Any = entry.get("fieldsV1") or {}
        for key in path:
            node = node.get(f"f:{key}") if isinstance(node, dict) else None
            if node is None:
                break
        else:
            return True
    return False


def replicas_handovers(desired: Iterable[Manifest],
                       observed: Mapping[tuple[str, str], Manifest]) -> list[Manifest]:
    """For each scaled workload the operator renders without `replicas` whose live object has
    replicas the operator applied: the apply that keeps the live count under HANDOVER_MANAGER."""
    handovers = []
    for manifest in desired:
        if manifest["kind"] not in SCALED_KINDS or "replicas" in manifest.get("spec", {}):
            continue
        live = observed.get((manifest["kind"], manifest["metadata"]["name"]))
        if live is None or "replicas" not in (live.get("spec") or {}) \
                or not owns(live, FIELD_MANAGER, ("spec", "replicas")):
            continue
        meta = manifest["metadata"]
        handovers.append({"apiVersion": manifest["apiVersion"], "kind": manifest["kind"],
                          "metadata": {"name": meta["name"], "namespace": meta["namespace"]},
                          "spec": {"replicas": live["spec"]["replicas"]}})
    return handovers
