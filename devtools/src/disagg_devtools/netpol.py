"""Whether Kubernetes NetworkPolicies let one pod reach another: the API's ingress semantics,
evaluated over labelled pods, so that rendered policies are checked as a table of flows rather
than as text.

Semantics (networking.k8s.io/v1): a pod is isolated for ingress when a policy in its namespace
selects it and lists Ingress among its policyTypes; traffic to an isolated pod is allowed when
any selecting policy has a rule whose peers match the source (podSelector: pods of the policy's
namespace; namespaceSelector: pods of matching namespaces; both: matching pods there; no `from`:
anyone) and whose ports match the destination port (a number, or a name of one of the
destination's container ports; no `ports`: any). ipBlock peers are not modelled: pods here have
no addresses. Egress is not evaluated.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Pod:
    name: str
    namespace: str
    labels: Mapping[str, str] = field(default_factory=dict)
    ports: Mapping[str, int] = field(default_factory=dict)  # named container ports


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector; the empty selector matches everything."""
    selector = selector or {}
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or []:
        key, operator = expression["key"], expression["operator"]
        values = expression.get("values") or []
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
        if operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {operator!r}")
    return True


def namespace_labels(namespace: str, extra: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """A namespace's labels: the API server always adds kubernetes.io/metadata.name."""
    return {**extra.get(namespace, {}), "kubernetes.io/metadata.name": namespace}


def _isolates_ingress(policy: Mapping[str, Any]) -> bool:
    spec = policy.get("spec") or {}
    types = spec.get("policyTypes")
    return "Ingress" in types if types else True


def _peer_matches(peer: Mapping[str, Any], policy_namespace: str, source: Pod,
                  namespaces: Mapping[str, Mapping[str, str]]) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"],
                                namespace_labels(source.namespace, namespaces)):
            return False
    elif source.namespace != policy_namespace:
        return False
    return selector_matches(peer.get("podSelector"), source.labels)


def _port_matches(entry: Mapping[str, Any], destination: Pod, port: int, protocol: str) -> bool:
    if entry.get("protocol", "TCP") != protocol:
        return False
    wanted = entry.get("port")
    if wanted is None:
        return True
    if isinstance(wanted, str):
        return destination.ports.get(wanted) == port
    return int(wanted) <= port <= int(entry.get("endPort", wanted))


def ingress_allowed(policies: Iterable[Mapping[str, Any]], source: Pod, destination: Pod,
                    port: int, protocol: str = "TCP",
                    namespaces: Mapping[str, Mapping[str, str]] | None = None) -> bool:
    """Whether `source` may open a connection to `destination` on `port`."""
    namespaces = namespaces or {}
    selecting = [p for p in policies if p.get("kind") == "NetworkPolicy"
                 and p["metadata"].get("namespace") == destination.namespace
                 and _isolates_ingress(p)
                 and selector_matches((p.get("spec") or {}).get("podSelector"),
                                      destination.labels)]
    if not selecting:
        return True
    for policy in selecting:
        for rule in (policy.get("spec") or {}).get("ingress") or []:
            peers = rule.get("from") or []
            ports = rule.get("ports") or []
            if peers and not any(_peer_matches(peer, policy["metadata"]["namespace"], source,
                                               namespaces) for peer in peers):
                continue
            if ports and not any(_port_matches(e, destination, port, protocol) for e in ports):
                continue
            return True
    return False


def pods_of(objects: Iterable[Mapping[str, Any]]) -> dict[str, Pod]:
    """One pod per rendered workload, with its template's labels and named ports, keyed by
    the workload's name."""
    pods = {}
    for obj in objects:
        if obj.get("kind") not in ("Deployment", "StatefulSet"):
            continue
        template = obj["spec"]["template"]
        ports = {p["name"]: int(p["containerPort"])
                 for c in template["spec"]["containers"] for p in c.get("ports") or []
                 if "name" in p}
        name = obj["metadata"]["name"]
        pods[name] = Pod(f"{name}-0", obj["metadata"]["namespace"],
                         dict(template["metadata"]["labels"]), ports)
    return pods
