"""A Secret the serving pods lack, named in the status from what the kubelet reports."""

from pathlib import Path

import yaml
from disagg_operator import plan
from disagg_operator.missing_secrets import missing_secrets
from disagg_operator.spec import parse_spec

ROOT = Path(__file__).resolve().parents[2]


def _tls_plan() -> plan.Plan:
    doc = yaml.safe_load((ROOT / "examples/deepseek-v2-lite-etcd-tls.yaml").read_text())
    return plan.build_plan(doc["metadata"]["name"], "default", parse_spec(doc["spec"]),
                           plan.ClusterAddressing("default"))


def _creating(name: str) -> dict:
    """A pod the kubelet cannot start yet: Pending, its containers ContainerCreating."""
    return {"metadata": {"name": name}, "status": {"phase": "Pending", "containerStatuses": [
        {"name": "vllm", "restartCount": 0, "state": {"waiting": {
            "reason": "ContainerCreating"}}}]}}


def _failed_mount(pod: str, secret: str) -> dict:
    """The kubelet's Event for a Secret volume it cannot mount."""
    return {"reason": "FailedMount", "type": "Warning",
            "involvedObject": {"kind": "Pod", "name": pod, "namespace": "default"},
            "message": f'MountVolume.SetUp failed for volume "etcd-client-tls" : secret '
                       f'"{secret}" not found'}


def test_the_plan_knows_which_spec_field_names_each_secret() -> None:
    fields = _tls_plan().secret_fields()
    assert fields == {"dsv2-lite-tls-etcd-client": ("spec.etcd.tls.clientSecret",),
                      "dsv2-lite-tls-etcd-server": ("spec.etcd.tls.serverSecret",)}


def test_a_missing_tls_secret_is_named_with_its_field_and_the_fix() -> None:
    pods = [_creating("dsv2-lite-prefill-a"), _creating("dsv2-lite-decode-b")]
    events = [_failed_mount(p["metadata"]["name"], "dsv2-lite-tls-etcd-client") for p in pods]
    (message,) = missing_secrets(pods, events, _tls_plan().secret_fields(), "default")
    assert message.startswith("Secret dsv2-lite-tls-etcd-client (named by "
                              "spec.etcd.tls.clientSecret) does not exist in namespace default")
    assert "kubectl -n default create secret" in message
    assert "dsv2-lite-decode-b, dsv2-lite-prefill-a" in message


def test_events_of_pods_that_have_started_since_are_not_counted() -> None:
    started = {"metadata": {"name": "dsv2-lite-prefill-a"}, "status": {
        "phase": "Running", "containerStatuses": [{"name": "vllm", "state": {"running": {}}}]}}
    events = [_failed_mount("dsv2-lite-prefill-a", "dsv2-lite-tls-etcd-client"),
              _failed_mount("dsv2-lite-gone", "dsv2-lite-tls-etcd-client")]
    assert missing_secrets([started], events, _tls_plan().secret_fields(), "default") == []


def test_a_missing_env_secret_or_key_is_read_from_the_container_state() -> None:
    def config_error(name: str, message: str) -> dict:
        return {"metadata": {"name": name}, "status": {"phase": "Pending", "containerStatuses": [
            {"name": "vllm", "state": {"waiting": {"reason": "CreateContainerConfigError",
                                                   "message": message}}}]}}
    pods = [config_error("p-1", 'secret "hf-token" not found'),
            config_error("p-2", "couldn't find key token in Secret default/hf"),
            config_error("p-3", "couldn't find key token in Secret default/hf")]
    messages = missing_secrets(pods, [], {"hf-token": ("spec.hfTokenSecret",),
                                          "hf": ("spec.hfTokenSecret",)}, "default")
    assert messages[0].startswith("Secret hf-token (named by spec.hfTokenSecret) does not exist")
    assert messages[1].startswith("Secret hf (named by spec.hfTokenSecret) has no key token")
    assert "p-2, p-3" in messages[1]
