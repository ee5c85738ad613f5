"""The rendered NetworkPolicies as a table of flows between labelled pods (evaluated with the
API's ingress semantics, disagg_devtools.netpol), and the PodDisruptionBudgets."""

from pathlib import Path
from typing import Any

import pytest
import yaml
from disagg_devtools.netpol import Pod, ingress_allowed, pods_of, selector_matches
from disagg_operator.association import Owner
from disagg_operator.render import render_spec
from disagg_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]
NS = "serving"
OPERATOR_NS = "disagg-system"
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
ANY_PORT = 41234  # a port Mooncake's transfer engine picked


def rendered(**changes: Any) -> list[dict[str, Any]]:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    spec = {**doc["spec"], "store": {"replicas": 1, "segmentSize": "1Gi"},
            "networkPolicy": {"metricsFrom": [MONITORING]}, **changes}
    return render_spec(Owner("mla", NS, "uid-0"), parse_spec(spec), "img:1",
                       operator_namespace=OPERATOR_NS)


def outsiders() -> dict[str, Pod]:
    other = {"app.kubernetes.io/instance": "other", "app.kubernetes.io/component": "prefill"}
    operator = {"app.kubernetes.io/name": "disagg-operator",
                "app.kubernetes.io/component": "operator"}
    return {
        "client": Pod("client", "apps", {"app": "web"}),
        "stranger": Pod("stranger", NS, {"app": "debug"}),
        "other-prefill": Pod("other-prefill", NS, other),  # another DisaggServing's
        "operator": Pod("operator", OPERATOR_NS, operator),
        "fake-operator": Pod("fake-operator", "apps", operator),
        "prometheus": Pod("prometheus", "monitoring", {"app": "prometheus"}),
    }


# (source, destination workload, port: a number or the destination's port name, allowed)
FLOWS = [
    ("client", "mla-proxy", "http", True),
    ("client", "mla-decode", "http", False),
    ("client", "mla-mooncake-master", "rpc", False),
    ("stranger", "mla-etcd", "client", False),
    ("mla-proxy", "mla-prefill", "http", True),
    ("mla-proxy", "mla-decode", "http", True),
    ("mla-prefill", "mla-decode", ANY_PORT, True),  # Mooncake transfers
    ("mla-decode", "mla-prefill", ANY_PORT, True),
    ("mla-decode", "mla-store", ANY_PORT, True),
    ("mla-store", "mla-decode", ANY_PORT, True),
    ("mla-proxy", "mla-store", ANY_PORT, False),  # the proxy only asks the master
    ("other-prefill", "mla-decode", ANY_PORT, False),
    ("other-prefill", "mla-store", ANY_PORT, False),
    ("mla-prefill", "mla-mooncake-master", "rpc", True),
    ("mla-store", "mla-mooncake-master", "rpc", True),
    ("mla-proxy", "mla-mooncake-master", "rpc", True),
    ("mla-prefill", "mla-mooncake-master", "metrics", False),
    ("mla-prefill", "mla-etcd", "client", True),  # registrar, Mooncake metadata
    ("mla-proxy", "mla-etcd", "client", True),  # instance discovery
    ("mla-store", "mla-etcd", "client", True),
    ("mla-etcd", "mla-etcd", "peer", True),
    ("mla-prefill", "mla-etcd", "peer", False),
    ("operator", "mla-etcd", "client", True),  # health check
    ("fake-operator", "mla-etcd", "client", False),
    ("operator", "mla-decode", "http", True),  # the planner's scrape
    ("operator", "mla-proxy", "http", True),
    ("operator", "mla-decode", ANY_PORT, False),
    ("prometheus", "mla-decode", "http", True),
    ("prometheus", "mla-mooncake-master", "metrics", True),
    ("prometheus", "mla-mooncake-master", "rpc", False),
    ("prometheus", "mla-store", "http", True),
    ("prometheus", "mla-store", "rpc", False),
    ("prometheus", "mla-etcd", "client", False),
]


def allowed(objects: list[dict[str, Any]], source: str, destination: str,
            port: int | str) -> bool:
    pods = {**pods_of(objects), **outsiders()}
    target = pods[destination]
    number = target.ports[port] if isinstance(port, str) else port
    return ingress_allowed(objects, pods[source], target, number)


@pytest.mark.parametrize(("source", "destination", "port", "expected"), FLOWS)
def test_flows_between_labelled_pods(source: str, destination: str, port: int | str,
                                     expected: bool) -> None:
    assert allowed(rendered(), source, destination, port) is expected


def test_clients_can_be_restricted_without_shutting_out_scrapes() -> None:
    objects = rendered(networkPolicy={"clientsFrom": [{"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "apps"}}}], "metricsFrom": [MONITORING]})
    assert allowed(objects, "client", "mla-proxy", "http")
    assert not allowed(objects, "stranger", "mla-proxy", "http")
    assert allowed(objects, "prometheus", "mla-proxy", "http")
    assert allowed(objects, "operator", "mla-proxy", "http")


def test_without_metrics_peers_only_the_operator_scrapes() -> None:
    objects = rendered(networkPolicy={})
    assert not allowed(objects, "prometheus", "mla-decode", "http")
    assert not allowed(objects, "prometheus", "mla-mooncake-master", "metrics")
    assert allowed(objects, "operator", "mla-decode", "http")


def test_disabled_policies_isolate_nothing() -> None:
    objects = rendered(networkPolicy={"enabled": False})
    assert not [o for o in objects if o["kind"] == "NetworkPolicy"]
    assert allowed(objects, "stranger", "mla-etcd", "client")  # the control: open again


def test_every_role_that_serves_requests_has_a_disruption_budget_of_one() -> None:
    budgets = {o["metadata"]["name"]: o["spec"] for o in rendered()
               if o["kind"] == "PodDisruptionBudget"}
    assert set(budgets) == {"mla-prefill", "mla-decode", "mla-proxy", "mla-store"}
    for name, spec in budgets.items():
        assert spec["maxUnavailable"] == 1
        assert spec["selector"]["matchLabels"]["app.kubernetes.io/component"] == \
            name.removeprefix("mla-")


def test_the_evaluator_follows_the_api_semantics() -> None:
    web = Pod("web", "a", {"app": "web"}, {"http": 80})
    deny_all = {"kind": "NetworkPolicy", "metadata": {"namespace": "a"},
                "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}}
    egress_only = {"kind": "NetworkPolicy", "metadata": {"namespace": "a"},
                   "spec": {"podSelector": {}, "policyTypes": ["Egress"]}}
    named = {"kind": "NetworkPolicy", "metadata": {"namespace": "a"}, "spec": {
        "podSelector": {"matchLabels": {"app": "web"}},
        "ingress": [{"from": [{"podSelector": {}}], "ports": [{"port": "http"}]}]}}
    peer = Pod("peer", "a")
    elsewhere = Pod("peer", "b")
    assert ingress_allowed([], peer, web, 80)
    assert not ingress_allowed([deny_all], peer, web, 80)
    assert ingress_allowed([egress_only], peer, web, 80)
    assert ingress_allowed([named], peer, web, 80)
    assert not ingress_allowed([named], peer, web, 81)
    assert not ingress_allowed([named], elsewhere, web, 80)  # podSelector: own namespace only
    assert selector_matches({"matchExpressions": [
        {"key": "tier", "operator": "NotIn", "values": ["db"]}]}, {})
    assert not selector_matches({"matchExpressions": [
        {"key": "tier", "operator": "Exists"}]}, {"app": "x"})


def test_with_etcd_tls_only_the_operator_and_scrapers_reach_etcds_plain_metrics_port() -> None:
    objects = rendered(etcd={"tls": {"clientSecret": "c", "serverSecret": "s"}},
                       kvTransfer={"mooncake": {"metadataBackend": "P2PHANDSHAKE"}})
    assert allowed(objects, "operator", "mla-etcd", "metrics")  # its health check
    assert allowed(objects, "prometheus", "mla-etcd", "metrics")
    assert not allowed(objects, "stranger", "mla-etcd", "metrics")
    assert not allowed(objects, "mla-proxy", "mla-etcd", "metrics")
    assert allowed(objects, "mla-proxy", "mla-etcd", "client")  # over TLS
