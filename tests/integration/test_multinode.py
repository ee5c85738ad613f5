"""Instances spanning nodes against the API emulator: without the LeaderWorkerSet API the
DisaggServing says so and nothing is applied; once its CRD is installed the operator creates
one LeaderWorkerSet per multi-node role, scales it alone, and rolls it on a change."""

from __future__ import annotations

import copy
from typing import Any

from disagg_operator.spec import PLURAL

from .conftest import Api, example

# The LeaderWorkerSet status as its CRD declares it: conditions are metav1.Conditions, whose
# every field is required (what the stand-in controller first wrote was refused by it).
LWS_STATUS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "replicas": {"type": "integer", "format": "int32"},
        "readyReplicas": {"type": "integer", "format": "int32"},
        "updatedReplicas": {"type": "integer", "format": "int32"},
        "hpaPodSelector": {"type": "string"},
        "conditions": {"type": "array", "items": {
            "type": "object",
            "required": ["lastTransitionTime", "message", "reason", "status", "type"],
            "properties": {
                "type": {"type": "string", "maxLength": 316},
                "status": {"type": "string", "enum": ["True", "False", "Unknown"]},
                "reason": {"type": "string", "minLength": 1, "maxLength": 1024},
                "message": {"type": "string", "maxLength": 32768},
                "lastTransitionTime": {"type": "string", "format": "date-time"},
                "observedGeneration": {"type": "integer", "format": "int64", "minimum": 0}}}},
    },
}

LWS_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "leaderworkersets.leaderworkerset.x-k8s.io"},
    "spec": {"group": "leaderworkerset.x-k8s.io", "scope": "Namespaced",
             "names": {"kind": "LeaderWorkerSet", "plural": "leaderworkersets",
                       "singular": "leaderworkerset", "shortNames": ["lws"]},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "subresources": {"status": {}, "scale": {
                               "specReplicasPath": ".spec.replicas",
                               "statusReplicasPath": ".status.replicas"}},
                           "schema": {"openAPIV3Schema": {
                               "type": "object",
                               "properties": {
                                   "apiVersion": {"type": "string"},
                                   "kind": {"type": "string"},
                                   "metadata": {"type": "object"},
                                   "spec": {"type": "object",
                                            "x-kubernetes-preserve-unknown-fields": True},
                                   "status": LWS_STATUS}}}}]},
}


def multi_node_decode() -> dict[str, Any]:
    body = copy.deepcopy(example("deepseek-v2-lite-1p2d.yaml"))
    body["spec"]["decode"].update(tensorParallelSize=16, nodesPerInstance=2)
    return body


async def test_without_leaderworkerset_nothing_is_applied_until_it_is_installed(
        api: Api) -> None:
    await api.create(multi_node_decode())
    cond = await api.wait_condition("dsv2-lite", "Ready", "False", "LeaderWorkerSetMissing")
    assert "install the LeaderWorkerSet controller" in cond["message"]
    await api.wait(lambda: any("LeaderWorkerSet" in e.get("message", "")
                               for e in api.events("LeaderWorkerSetMissing")),
                   "a Warning Event")
    assert api.children("dsv2-lite") == {}

    await api._request("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions",
                       LWS_CRD)
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady", timeout=30)
    group = api.get("leaderworkersets", "dsv2-lite-decode", group="leaderworkerset.x-k8s.io")
    assert group is not None
    template = group["spec"]["leaderWorkerTemplate"]
    assert (group["spec"]["replicas"], template["size"]) == (2, 2)
    assert template["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert ("deployments", "dsv2-lite-decode") not in api.children("dsv2-lite")
    assert ("deployments", "dsv2-lite-prefill") in api.children("dsv2-lite")  # one node

    mark = api.mark()
    await api.patch_spec("dsv2-lite", {"decode": {"replicas": 3}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady", generation=2)
    assert [w for w in api.writes_since(mark) if PLURAL not in w] == [
        "PATCH /apis/leaderworkerset.x-k8s.io/v1/namespaces/default/leaderworkersets/"
        "dsv2-lite-decode"]
    assert api.dsv("dsv2-lite")["status"]["decode"]["summary"] == "3/3"  # type: ignore[index]

    await api.patch_spec("dsv2-lite", {"image": "registry.example/serving:2"})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady", generation=3)
    group = api.get("leaderworkersets", "dsv2-lite-decode", group="leaderworkerset.x-k8s.io")
    assert group is not None
    for part in ("leaderTemplate", "workerTemplate"):
        (container, *_) = group["spec"]["leaderWorkerTemplate"][part]["spec"]["containers"]
        assert container["image"] == "registry.example/serving:2"
