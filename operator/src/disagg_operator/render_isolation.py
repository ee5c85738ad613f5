"""Render: who may reach a DisaggServing's pods (ingress NetworkPolicies, one per component)
and how many of a role's pods a voluntary disruption may take at once (PodDisruptionBudgets).
Pure, golden-tested with the rest of render.

The flows allowed, each only between pods of the same DisaggServing unless said otherwise:
- clients (spec.networkPolicy.clientsFrom, default any) -> the proxy's port;
- the proxy -> the vLLM instances' HTTP port;
- vLLM instances and store pods <-> each other on any port: Mooncake's transfer engine listens
  on ports it picks at start, so they cannot be named;
- vLLM instances, store pods and the proxy (its store lookups) -> the master's RPC port;
- vLLM instances (their registrars and Mooncake's metadata), store pods, the proxy (instance
  discovery) and the operator (its health check) -> etcd's client port; etcd <-> etcd peers;
  with TLS, the operator and metricsFrom -> etcd's plain metrics port (/health, /metrics);
- the operator (the planner's scrape) and spec.networkPolicy.metricsFrom -> every metrics port.
Egress is not restricted.
"""

from __future__ import annotations

from typing import Any

from disagg_operator import plan as plans
from disagg_operator.association import (
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    Owner,
    child_meta,
    child_name,
    selector_labels,
)
from disagg_operator.plan import Role

Manifest = dict[str, Any]

# The operator's pods, as the chart labels them.
OPERATOR_POD_LABELS = {"app.kubernetes.io/name": "disagg-operator",
                       "app.kubernetes.io/component": "operator"}
# Roles a voluntary disruption (a node drain) takes one pod of at a time.
BUDGETED_ROLES = (Role.PREFILL, Role.DECODE, Role.PROXY, Role.STORE)
MOONCAKE_PEERS = (Role.PREFILL, Role.DECODE, Role.STORE)
MASTER_CLIENTS = (Role.PREFILL, Role.DECODE, Role.STORE, Role.PROXY)
ETCD_CLIENTS = (Role.PREFILL, Role.DECODE, Role.STORE, Role.PROXY)


def render_isolation(owner: Owner, plan: plans.Plan,
                     operator_namespace: str | None) -> list[Manifest]:
    objects = [_budget(owner, c.role) for c in plan.components if c.role in BUDGETED_ROLES]
    if plan.network_policy is not None:
        objects += [_policy(owner, plan, c, operator_namespace) for c in plan.components]
    return objects


def _budget(owner: Owner, role: Role) -> Manifest:
    name = child_name(owner.name, role)
    return {"apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
            "metadata": child_meta(owner, name, role),
            "spec": {"maxUnavailable": 1,
                     "selector": {"matchLabels": selector_labels(owner.name, role)}}}


def _policy(owner: Owner, plan: plans.Plan, component: plans.Component,
            operator_namespace: str | None) -> Manifest:
    role = component.role
    assert plan.network_policy is not None
    ports = dict(component.main.ports)
    rules: list[dict[str, Any]] = []

    def allow(peers: list[dict[str, Any]] | None, *port_names: str) -> None:
        rule: dict[str, Any] = {}
        if peers is not None:
            if not peers:
                return  # nobody: no rule
            rule["from"] = peers
        if port_names:
            rule["ports"] = [{"port": ports[n], "protocol": "TCP"} for n in port_names]
        rules.append(rule)

    observers = _operator(operator_namespace) + list(plan.network_policy.metrics_from or [])
    if role == Role.PROXY:
        clients = plan.network_policy.clients_from
        # Its metrics share the clients' port: restricted clients do not shut out scrapes.
        allow(None if clients is None else [*clients, *observers], "http")
    elif role.is_vllm:
        allow([_peers(owner, (Role.PROXY,)), *observers], "http")
        allow([_peers(owner, MOONCAKE_PEERS)])
    elif role == Role.STORE:
        allow([_peers(owner, MOONCAKE_PEERS)])
        allow(observers, "http")
    elif role == Role.MOONCAKE_MASTER:
        allow([_peers(owner, MASTER_CLIENTS)], "rpc")
        allow(observers, "metrics")
    elif role == Role.ETCD:
        allow([_peers(owner, ETCD_CLIENTS), *_operator(operator_namespace)], "client")
        allow([_peers(owner, (Role.ETCD,))], "peer")
        if "metrics" in ports:  # with TLS: the operator's health check and scrapes
            allow(observers, "metrics")
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": child_meta(owner, child_name(owner.name, role), role),
            "spec": {"podSelector": {"matchLabels": selector_labels(owner.name, role)},
                     "policyTypes": ["Ingress"], "ingress": rules}}


def _peers(owner: Owner, roles: tuple[Role, ...]) -> dict[str, Any]:
    """Pods of these roles of this DisaggServing (in its namespace)."""
    return {"podSelector": {
        "matchLabels": {LABEL_INSTANCE: owner.name},
        "matchExpressions": [{"key": LABEL_COMPONENT, "operator": "In",
                              "values": [str(r) for r in roles]}]}}


def _operator(namespace: str | None) -> list[dict[str, Any]]:
    """The operator's pods; none when it does not run in the cluster (then it is no pod)."""
    if namespace is None:
        return []
    return [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
             "podSelector": {"matchLabels": dict(OPERATOR_POD_LABELS)}}]
