"""The Helm chart: lint, versions in step, and a real `helm install` (Helm's Go SDK) into the
API emulator, cluster-wide and for a list of namespaces."""

from __future__ import annotations

import asyncio
import json
import tomllib
from pathlib import Path
from typing import Any

import disagg_operator
import yaml
from disagg_devtools.emulator.helm import CHART, HELM_ACTION, helm_install
from disagg_devtools.emulator.sandbox import Sandbox
from disagg_operator.child_kinds import CHILD_KINDS, CHILD_VERBS
from disagg_operator.crd import render_crd_yaml

from .conftest import ROOT, run, stored


def chart_meta() -> dict[str, Any]:
    return yaml.safe_load((CHART / "Chart.yaml").read_text())


def test_chart_and_operator_versions_are_in_step() -> None:
    package = tomllib.loads((ROOT / "operator" / "pyproject.toml").read_text())
    version = package["project"]["version"]
    assert chart_meta()["version"] == chart_meta()["appVersion"] == version
    assert disagg_operator.__version__ == version
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert values["servingImage"].endswith(f":{version}")


def test_chart_installs_the_generated_crd_not_a_copy() -> None:
    chart_crd = CHART / "crds" / "disaggserving.yaml"
    assert chart_crd.is_symlink()
    assert chart_crd.resolve() == (ROOT / "crds" / "disaggserving.yaml").resolve()
    assert chart_crd.read_text() == render_crd_yaml()


def test_helm_lint(tools: Path) -> None:
    result = run(tools / "python", HELM_ACTION, "lint", CHART)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["Errors"] is None
    # Severity 1 is INFO (e.g. "icon is recommended"); 2 WARNING, 3 ERROR.
    assert [m for m in report["Messages"] if m["Severity"] > 1] == []


async def test_helm_install_cluster_wide(cluster: Sandbox, tools: Path) -> None:
    release = await helm_install(cluster, tools)
    assert release["info"]["status"] == "deployed"
    assert "kubectl wait --for=condition=Ready" in release["info"]["notes"]

    (crd,) = stored(cluster, "customresourcedefinitions")
    assert crd["metadata"]["name"] == "disaggservings.serving.disagg.dev"
    roles = {r["metadata"]["name"]: r for r in stored(cluster, "clusterroles")}
    assert set(roles) == {"disagg-disagg-operator", "disagg-disagg-operator-discovery"}
    # In its own namespace only the leader election's Lease: create, and read and renew that
    # one by name.
    (lease_role,) = stored(cluster, "roles")
    assert lease_role["metadata"]["namespace"] == "disagg-system"
    assert lease_role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
         "resourceNames": ["disagg-operator"], "verbs": ["get", "update"]}]
    rules = roles["disagg-disagg-operator"]["rules"]
    assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)
    granted = {(g, res, v) for r in rules for g in r["apiGroups"] for res in r["resources"]
               for v in r["verbs"]}
    assert ("", "secrets", "get") not in granted  # the operator never reads Secrets
    # Pods are only listed (for their container states), never read one by one or changed.
    assert {v for g, res, v in granted if res == "pods"} == {"list"}
    # Every kind the operator creates, with exactly what it does to it (child_kinds).
    for child in CHILD_KINDS:
        assert {v for g, res, v in granted if (g, res) == (child.group, child.plural)} == \
            set(CHILD_VERBS), child.kind
    assert ("serving.disagg.dev", "disaggservings/status", "patch") in granted

    (deployment,) = stored(cluster, "deployments")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["image"] == "disagg-operator/operator:0.1.0"
    assert not any(a.startswith("--namespace") for a in container["args"])
    assert deployment["spec"]["replicas"] == 2 and "--leader-election" in container["args"]
    (service,) = stored(cluster, "services")
    assert service["spec"]["ports"][0]["name"] == "metrics"


async def test_helm_install_for_listed_namespaces(cluster: Sandbox, tools: Path) -> None:
    await helm_install(cluster, tools, {"watchNamespaces": ["team-a", "team-b"],
                                        "servingImage": "registry.example/serving:9"})
    roles = [r for r in stored(cluster, "roles") if "leader-election" not in r["metadata"]["name"]]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    bindings = stored(cluster, "rolebindings")
    assert {b["subjects"][0]["namespace"] for b in bindings} == {"disagg-system"}
    # Only the read-only discovery role stays cluster-wide.
    (cluster_role,) = stored(cluster, "clusterroles")
    assert cluster_role["rules"] == [{"apiGroups": ["apiextensions.k8s.io"],
                                      "resources": ["customresourcedefinitions"],
                                      "verbs": ["list", "watch"]}]
    (deployment,) = stored(cluster, "deployments")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert "--namespace=team-a" in container["args"]
    assert container["env"] == [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "DISAGG_DEFAULT_IMAGE", "value": "registry.example/serving:9"},
        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}]


async def test_the_operators_etcd_client_certificate_is_mounted_not_read(
        cluster: Sandbox, tools: Path) -> None:
    await helm_install(cluster, tools, {"etcdClientTLS": {"secretName": "operator-etcd"}})
    (deployment,) = stored(cluster, "deployments")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert {"name": "DISAGG_ETCD_TLS_DIR", "value": "/etc/disagg-operator/etcd-tls"} in \
        container["env"]
    assert {"name": "etcd-tls", "mountPath": "/etc/disagg-operator/etcd-tls",
            "readOnly": True} in container["volumeMounts"]
    assert {"name": "etcd-tls", "secret": {"secretName": "operator-etcd",
                                           "defaultMode": 0o440}} in pod["volumes"]
    assert pod["securityContext"]["fsGroup"] == 65532


async def test_helm_install_rejects_bad_values(cluster: Sandbox, tools: Path) -> None:
    env = {**cluster.env, "HELM_DRIVER": "memory"}
    result = await asyncio.to_thread(
        run, tools / "python", HELM_ACTION, "install",
        cluster.kubeconfig, "disagg-system", "disagg", CHART,
        json.dumps({"watchNamespaces": ["Not_A_Namespace"]}), env=env, timeout=120)
    assert result.returncode != 0
    assert "watchNamespaces" in result.stderr
    assert stored(cluster, "deployments") == []


def _crd(group: str, kind: str, plural: str) -> dict[str, Any]:
    return {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
            "metadata": {"name": f"{plural}.{group}"},
            "spec": {"group": group, "scope": "Namespaced",
                     "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
                     "versions": [{"name": "v1", "served": True, "storage": True,
                                   "schema": {"openAPIV3Schema": {
                                       "type": "object",
                                       "x-kubernetes-preserve-unknown-fields": True}}}]}}


async def test_monitoring_objects_only_where_the_prometheus_operator_is(
        cluster: Sandbox, tools: Path) -> None:
    await helm_install(cluster, tools)
    assert not stored(cluster, "podmonitors")  # no monitoring.coreos.com CRDs here
    (dashboard,) = [c for c in stored(cluster, "configmaps")
                    if c["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["disagg-serving.json"])["uid"] == "disagg-serving"


async def test_monitoring_objects_with_the_prometheus_operator(
        cluster: Sandbox, tools: Path) -> None:
    for kind, plural in (("ServiceMonitor", "servicemonitors"), ("PodMonitor", "podmonitors"),
                         ("PrometheusRule", "prometheusrules")):
        cluster.emulator.register_crd(_crd("monitoring.coreos.com", kind, plural))
    await helm_install(cluster, tools)
    (pod_monitor,) = stored(cluster, "podmonitors")
    assert pod_monitor["spec"]["namespaceSelector"] == {"any": True}
    assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} == {"http", "metrics"}
    (service_monitor,) = stored(cluster, "servicemonitors")
    assert service_monitor["spec"]["endpoints"][0]["honorLabels"] is True
    (rule,) = stored(cluster, "prometheusrules")
    alerts = {r["alert"] for g in rule["spec"]["groups"] for r in g["rules"]}
    assert alerts == {"DisaggNoHealthyDecode", "DisaggKVLoadFailuresRising",
                      "DisaggStoreNearCapacity", "DisaggOperatorReconcileErrors"}
