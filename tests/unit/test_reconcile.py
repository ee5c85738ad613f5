"""The pure decisions of the reconciler: when a child must be applied."""

import copy

from disagg_operator.reconcile import (
    ANNOTATION_APPLIED_HASH,
    apply_reason,
    first_difference,
    with_applied_hash,
)

DEPLOYMENT = {
    "apiVersion": "apps/v1", "kind": "Deployment",
    "metadata": {"name": "x-decode", "namespace": "default", "labels": {"a": "b"}},
    "spec": {"replicas": 2, "template": {"spec": {"containers": [
        {"name": "vllm", "image": "img:1", "env": [],
         "resources": {"limits": {"memory": "1Gi", "cpu": "1"}}}]}}},
}


def live_copy(manifest: dict) -> dict:
    """What an API server returns: defaults added, empty values dropped, quantities normalized."""
    live = copy.deepcopy(manifest)
    live["metadata"]["uid"] = "u"
    live["spec"]["strategy"] = {"type": "RollingUpdate"}
    container = live["spec"]["template"]["spec"]["containers"][0]
    del container["env"]
    container["terminationMessagePath"] = "/dev/termination-log"
    container["resources"]["limits"]["cpu"] = "1000m"
    live["status"] = {"readyReplicas": 2}
    return live


def test_hash_is_stable_and_changes_with_content() -> None:
    first = with_applied_hash(DEPLOYMENT)
    assert with_applied_hash(DEPLOYMENT) == first
    changed = copy.deepcopy(DEPLOYMENT)
    changed["spec"]["replicas"] = 3
    assert (with_applied_hash(changed)["metadata"]["annotations"][ANNOTATION_APPLIED_HASH]
            != first["metadata"]["annotations"][ANNOTATION_APPLIED_HASH])
    assert "annotations" not in DEPLOYMENT["metadata"]  # the input is not modified


def test_in_place_child_needs_no_apply_despite_server_defaults() -> None:
    desired = with_applied_hash(DEPLOYMENT)
    assert apply_reason(desired, live_copy(desired)) is None


def test_missing_changed_and_drifted_children_are_applied() -> None:
    desired = with_applied_hash(DEPLOYMENT)
    assert apply_reason(desired, None) == "missing"
    older = copy.deepcopy(desired)
    older["metadata"]["annotations"][ANNOTATION_APPLIED_HASH] = "old"
    assert apply_reason(desired, live_copy(older)) == "changed"
    drifted = live_copy(desired)
    drifted["spec"]["replicas"] = 5  # someone scaled it by hand
    assert apply_reason(desired, drifted) == "drifted at spec.replicas"


def test_first_difference_names_the_path() -> None:
    assert first_difference({"a": [{"b": 1}]}, {"a": [{"b": 2}]}, "spec") == "spec.a[0].b"
    assert first_difference({"a": [1, 2]}, {"a": [1]}, "spec") == "spec.a"
    assert first_difference({"m": "512Mi"}, {"m": 536870912}, "spec") is None
    assert first_difference({"m": "abc"}, {"m": "abd"}, "spec") == "spec.m"
