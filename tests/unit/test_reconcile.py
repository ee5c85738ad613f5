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


class RecordingApi:
    """A stand-in for the Kubernetes API (named as such): children as applied, status
    patches recorded. The emulator-backed tests in tests/integration use the real path."""

    def __init__(self, serves: frozenset[str] = frozenset({"LeaderWorkerSet"})) -> None:
        self.children: dict = {}
        self.status_patches: list[dict] = []
        self.served = serves  # add-on kinds the cluster has

    async def serves(self, kind: str, namespace: str) -> bool:
        return kind in self.served

    async def list_children(self, owner):  # noqa: ANN001, ANN201
        return dict(self.children)

    async def list_pods(self, owner):  # noqa: ANN001, ANN201
        return []

    async def list_pod_events(self, namespace, reason):  # noqa: ANN001, ANN201
        return []

    async def get(self, kind, namespace, name):  # noqa: ANN001, ANN201
        return self.children.get((kind, name))

    async def apply(self, manifest, dry_run=False, field_manager="disagg-operator"):  # noqa: ANN001, ANN201
        if not dry_run:
            self.children[(manifest["kind"], manifest["metadata"]["name"])] = manifest
        return manifest

    async def delete(self, kind, namespace, name):  # noqa: ANN001, ANN201
        self.children.pop((kind, name), None)

    async def patch_status(self, namespace, name, status_patch):  # noqa: ANN001, ANN201
        self.status_patches.append(status_patch)


async def test_a_stale_snapshot_neither_rewrites_the_status_nor_repeats_its_events() -> None:
    """A child's event can wake the reconciler before its own status write comes back through
    the watch: the snapshot then still shows the old status."""
    from pathlib import Path

    import yaml
    from disagg_operator.etcd_health import EtcdHealthChecker
    from disagg_operator.reconcile import Reconciler

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples"
                          / "llama-1p1d.yaml").read_text())
    # A spec the operator refuses: its Warning Event is the one that was posted again and
    # again from stale snapshots.
    body = {"metadata": {"name": "llama", "namespace": "default", "uid": "u1",
                         "generation": 1},
            "spec": {**doc["spec"], "etcd": {"mode": "External"}}}
    api = RecordingApi()
    reconciler = Reconciler(api, EtcdHealthChecker(timeout=0.1), "img:1",  # type: ignore[arg-type]
                            clock=lambda: "t")
    first = await reconciler.reconcile(body)
    assert first.status_written and [e.reason for e in first.events] == ["InvalidSpec"]
    again = await reconciler.reconcile(body)  # the same stale snapshot: no status in it yet
    assert not again.status_written and again.events == []
    assert len(api.status_patches) == 1
    caught_up = await reconciler.reconcile({**body, "status": first.status})
    assert not caught_up.status_written and caught_up.events == []


async def test_the_reconciler_says_when_to_look_again() -> None:
    """Soon while not Ready (a spec to fix, an etcd that may come back, pods starting)."""
    from disagg_operator.etcd_health import EtcdHealthChecker
    from disagg_operator.reconcile import Reconciler

    body = {"metadata": {"name": "x", "namespace": "default", "uid": "u2", "generation": 1},
            "spec": {}}
    reconciler = Reconciler(RecordingApi(), EtcdHealthChecker(timeout=0.1), "img:1",  # type: ignore[arg-type]
                            clock=lambda: "t", resync_seconds=60.0, not_ready_resync_seconds=3.0)
    assert (await reconciler.reconcile(body)).requeue_after == 3.0


async def test_a_multi_node_instance_without_leaderworkerset_applies_nothing() -> None:
    from disagg_operator.etcd_health import EtcdHealthChecker
    from disagg_operator.reconcile import Reconciler

    body = {"metadata": {"name": "x", "namespace": "default", "uid": "u3", "generation": 1},
            "spec": {"model": {"name": "m"}, "decode": {"tensorParallelSize": 16,
                                                        "nodesPerInstance": 2}}}
    api = RecordingApi(serves=frozenset())
    reconciler = Reconciler(api, EtcdHealthChecker(timeout=0.1), "img:1",  # type: ignore[arg-type]
                            clock=lambda: "t")
    result = await reconciler.reconcile(body)
    ready = next(c for c in result.status["conditions"] if c["type"] == "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "LeaderWorkerSetMissing")
    assert "install the LeaderWorkerSet controller" in ready["message"]
    assert api.children == {} and result.applied == []
    assert [e.reason for e in result.events] == ["LeaderWorkerSetMissing"]


def test_a_status_patch_removes_keys_gone_from_nested_maps() -> None:
    """The API server merges a status patch: a key left out of a nested map stays unless it is
    sent as null (status.autoscaling.specIgnored, once the spec's count is back)."""
    from disagg_operator.reconcile import merge_patch

    old = {"autoscaling": {"mode": "Planner", "specIgnored": "x", "decode": {"desired": 2}},
           "endpoint": "e"}
    new = {"autoscaling": {"mode": "Planner", "decode": {"desired": 3}}}
    assert merge_patch(old, new) == {"endpoint": None, "autoscaling": {
        "mode": "Planner", "specIgnored": None, "decode": {"desired": 3}}}
