"""The pods a cluster would run for rendered manifests (disagg_devtools.containers.pods)."""

from pathlib import Path

import pytest
import yaml
from disagg_devtools.containers.pods import (
    PodFacts,
    UnsupportedObject,
    command_line,
    container_env,
    expand,
    workload_pods,
)
from disagg_operator.association import Owner
from disagg_operator.render import render_spec
from disagg_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


def _seed() -> list[dict]:
    doc = yaml.safe_load((ROOT / "tests/containers/tiny-mla-1p2d.yaml").read_text())
    return render_spec(Owner("tiny-mla", "default", "uid"), parse_spec(doc["spec"]),
                       "disagg-operator/serving:0.1.0")


def test_each_replica_is_a_pod_named_by_the_services_that_select_it() -> None:
    pods = {p.name: p for p in workload_pods(_seed(), "default")}
    assert set(pods) == {"tiny-mla-etcd-0", "tiny-mla-mooncake-master-0", "tiny-mla-prefill-0",
                         "tiny-mla-decode-0", "tiny-mla-decode-1", "tiny-mla-proxy-0"}
    assert "tiny-mla-decode.default.svc.cluster.local" in pods["tiny-mla-decode-1"].dns_names
    etcd = pods["tiny-mla-etcd-0"].dns_names
    # The client Service and, under the headless peer Service, the member's own name.
    assert "tiny-mla-etcd-client.default.svc.cluster.local" in etcd
    assert "tiny-mla-etcd-0.tiny-mla-etcd" in etcd
    assert not any("decode" in n for n in pods["tiny-mla-prefill-0"].dns_names)


def test_env_comes_from_fields_and_secrets_and_expands_in_args() -> None:
    container = {"env": [{"name": "POD_NAME", "valueFrom": {"fieldRef": {
                              "fieldPath": "metadata.name"}}},
                         {"name": "POD_IP", "valueFrom": {"fieldRef": {
                             "fieldPath": "status.podIP"}}},
                         {"name": "URL", "value": "http://$(POD_IP):8000"},
                         {"name": "KEY", "valueFrom": {"secretKeyRef": {
                             "name": "s", "key": "token"}}}],
                 "command": ["etcd"], "args": ["--name=$(POD_NAME)", "$$(POD_NAME)",
                                               "$(UNSET)"]}
    secrets = {"s": {"kind": "Secret", "data": {"token": "c2VjcmV0"}}}
    env = container_env(container, PodFacts("p-0", "ns", "10.0.0.5"), secrets, {})
    assert env == {"POD_NAME": "p-0", "POD_IP": "10.0.0.5", "URL": "http://10.0.0.5:8000",
                   "KEY": "secret"}
    assert command_line(container, env) == (["etcd"], ["--name=p-0", "$(POD_NAME)",
                                                       "$(UNSET)"])
    assert expand("$(A)$(A)", {"A": "x"}) == "xx"


def test_a_service_port_that_differs_from_the_pods_is_refused() -> None:
    objs = _seed()
    proxy_service = next(o for o in objs if o["kind"] == "Service"
                         and o["metadata"]["name"] == "tiny-mla-proxy")
    proxy_service["spec"]["ports"][0]["port"] = 80
    with pytest.raises(UnsupportedObject, match="tiny-mla-proxy port 80"):
        workload_pods(objs, "default")
