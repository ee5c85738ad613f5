"""The kopf operator reconciling DisaggServings in the API emulator, with a real etcd."""

from __future__ import annotations

from disagg_devtools.emulator.sandbox import Sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_operator.handlers import OperatorConfig
from disagg_operator.spec import GROUP, MAX_NAME_LENGTH, PLURAL, VERSION
from prometheus_client import REGISTRY

from .conftest import NAMESPACE, Api, example

SEED_CHILDREN = {
    ("configmaps", "dsv2-lite-config"),
    ("statefulsets", "dsv2-lite-etcd"),
    ("services", "dsv2-lite-etcd"),
    ("services", "dsv2-lite-etcd-client"),
    ("deployments", "dsv2-lite-mooncake-master"),
    ("services", "dsv2-lite-mooncake-master"),
    ("deployments", "dsv2-lite-prefill"),
    ("services", "dsv2-lite-prefill"),
    ("deployments", "dsv2-lite-decode"),
    ("services", "dsv2-lite-decode"),
    ("deployments", "dsv2-lite-proxy"),
    ("services", "dsv2-lite-proxy"),
    *(("poddisruptionbudgets", f"dsv2-lite-{role}") for role in ("prefill", "decode", "proxy")),
    *(("networkpolicies", f"dsv2-lite-{role}")
      for role in ("etcd", "mooncake-master", "prefill", "decode", "proxy")),
}


def reconciles(name: str) -> float:
    return REGISTRY.get_sample_value("disagg_operator_reconcile_duration_seconds_count",
                                     {"namespace": NAMESPACE, "name": name}) or 0.0


async def create_seed(api: Api) -> None:
    await api.create(example("deepseek-v2-lite-1p2d.yaml"))
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady")


async def test_create_renders_every_child_and_reports_ready(api: Api) -> None:
    await create_seed(api)
    children = api.children("dsv2-lite")
    assert set(children) == SEED_CHILDREN
    uid = api.dsv("dsv2-lite")["metadata"]["uid"]  # type: ignore[index]
    for obj in children.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["uid"] == uid and ref["controller"] is True
    status = api.dsv("dsv2-lite")["status"]  # type: ignore[index]
    assert status["observedGeneration"] == 1
    assert (status["prefill"]["summary"], status["decode"]["summary"]) == ("1/1", "2/2")
    assert status["etcd"]["healthy"] is True
    assert status["endpoint"] == "http://dsv2-lite-proxy.default.svc.cluster.local:8000"
    assert api.condition("dsv2-lite", "Progressing")["reason"] == "RolloutComplete"  # type: ignore[index]
    assert api.condition("dsv2-lite", "Degraded")["status"] == "False"  # type: ignore[index]
    await api.wait(lambda: api.events("Ready"), "a Ready event")


async def test_resync_without_change_makes_no_writes(api: Api) -> None:
    await create_seed(api)
    before = reconciles("dsv2-lite")
    mark = api.mark()
    await api.wait(lambda: reconciles("dsv2-lite") >= before + 3, "three resyncs")
    assert api.writes_since(mark) == []


async def test_scale_decode_applies_only_the_decode_workload(api: Api) -> None:
    await create_seed(api)
    mark = api.mark()
    await api.patch_spec("dsv2-lite", {"decode": {"replicas": 3}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=2)
    assert api.get("deployments", "dsv2-lite-decode")["spec"]["replicas"] == 3  # type: ignore[index]
    assert api.dsv("dsv2-lite")["status"]["decode"]["summary"] == "3/3"  # type: ignore[index]
    child_writes = [w for w in api.writes_since(mark) if PLURAL not in w]
    assert child_writes == [
        "PATCH /apis/apps/v1/namespaces/default/deployments/dsv2-lite-decode"]
    await api.wait(lambda: any("decode scaled from 2 to 3" in e.get("message", "")
                               for e in api.events("Scaled")), "a Scaled event")


async def test_image_change_rolls_out_and_reports_progress(cluster: Sandbox, api: Api) -> None:
    await create_seed(api)
    cluster.emulator.readiness = "manual"  # workloads now report only what the test says
    await api.patch_spec("dsv2-lite", {"image": "test/serving:2"})
    await api.wait_condition("dsv2-lite", "Progressing", "True", "RollingOut", generation=2)
    workloads = [obj for (plural, _), obj in api.children("dsv2-lite").items()
                 if plural == "deployments"]
    for obj in workloads:
        images = {c["image"] for c in obj["spec"]["template"]["spec"]["containers"]}
        assert images == {"test/serving:2"}, obj["metadata"]["name"]
    # The old pods still serve: Ready stays True while the rollout is under way.
    assert api.condition("dsv2-lite", "Ready")["status"] == "True"  # type: ignore[index]
    for obj in workloads:
        await cluster.emulator.set_workload_ready("deployments", NAMESPACE,
                                                  obj["metadata"]["name"])
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=2)
    assert api.condition("dsv2-lite", "Progressing")["status"] == "False"  # type: ignore[index]


async def test_switch_to_external_etcd_prunes_managed_etcd(api: Api, etcd: EtcdProcess) -> None:
    await create_seed(api)
    await api.patch_spec("dsv2-lite", {"etcd": {"mode": "External",
                                                "endpoints": [etcd.endpoint]}})
    await api.wait(lambda: ("statefulsets", "dsv2-lite-etcd") not in api.children("dsv2-lite"),
                   "the managed etcd to be pruned")
    children = set(api.children("dsv2-lite"))
    assert children == SEED_CHILDREN - {("statefulsets", "dsv2-lite-etcd"),
                                        ("services", "dsv2-lite-etcd"),
                                        ("services", "dsv2-lite-etcd-client"),
                                        ("networkpolicies", "dsv2-lite-etcd")}
    config = api.get("configmaps", "dsv2-lite-config", group="", version="v1")
    assert f"etcd://{etcd.endpoint}" in config["data"]["mooncake.json"]  # type: ignore[index]
    cond = await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=2)
    assert api.dsv("dsv2-lite")["status"]["etcd"] == {  # type: ignore[index]
        "mode": "External", "endpoints": [etcd.endpoint], "healthy": True,
        "message": f"etcd answers at {etcd.endpoint}"}
    assert cond["observedGeneration"] == 2


async def test_unreachable_etcd_is_reported_and_recovers(api: Api, etcd: EtcdProcess) -> None:
    await create_seed(api)
    etcd.stop()
    cond = await api.wait_condition("dsv2-lite", "Ready", "False", "EtcdUnhealthy")
    assert "dsv2-lite-etcd-client.default.svc" in cond["message"]
    assert api.condition("dsv2-lite", "Degraded")["reason"] == "EtcdUnhealthy"  # type: ignore[index]
    await api.wait(lambda: api.events("EtcdUnhealthy"), "an EtcdUnhealthy event")
    await etcd.start()  # same ports, same data
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady")


async def test_invalid_spec_applies_nothing_and_a_fix_recovers(api: Api) -> None:
    await create_seed(api)
    before = api.children("dsv2-lite")
    mark = api.mark()
    # A cross-field rule (CEL at a real API server; the emulator skips CEL, the operator not).
    await api.patch_spec("dsv2-lite", {"etcd": {"mode": "External"}})
    cond = await api.wait_condition("dsv2-lite", "Ready", "False", "InvalidSpec")
    assert "spec.etcd" in cond["message"] and "endpoints" in cond["message"]
    assert cond["observedGeneration"] == 2
    await api.wait(lambda: any("spec.etcd" in e.get("message", "")
                               for e in api.events("InvalidSpec")), "an InvalidSpec event")
    assert [w for w in api.writes_since(mark) if PLURAL not in w] == []
    assert api.children("dsv2-lite") == before
    assert (REGISTRY.get_sample_value("disagg_operator_reconcile_errors_total", {
        "namespace": NAMESPACE, "name": "dsv2-lite", "reason": "InvalidSpec"}) or 0) >= 1

    await api.patch_spec("dsv2-lite", {"etcd": {"mode": "Managed"}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady", generation=3)


async def test_invalid_new_object_creates_no_children(api: Api) -> None:
    body = example("llama-1p1d.yaml")
    body["spec"]["prefill"] = {"replicas": 1, "extraArgs": ["--kv-transfer-config={}"]}
    await api.create(body)
    cond = await api.wait_condition("llama", "Ready", "False", "InvalidSpec")
    assert "spec.prefill.extraArgs" in cond["message"]
    assert api.children("llama") == {}


async def test_deleted_children_and_drift_are_repaired(api: Api) -> None:
    await create_seed(api)
    await api.delete(f"/api/v1/namespaces/{NAMESPACE}/services/dsv2-lite-proxy")
    await api.wait(lambda: ("services", "dsv2-lite-proxy") in api.children("dsv2-lite"),
                   "the proxy Service to be recreated")
    await api._request("PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/"
                       "dsv2-lite-prefill", {"spec": {"replicas": 5}},
                       content_type="application/merge-patch+json")
    await api.wait(lambda: (api.get("deployments", "dsv2-lite-prefill") or {})
                   .get("spec", {}).get("replicas") == 1, "the prefill replicas to be restored")


async def test_delete_removes_the_object_and_its_children(api: Api) -> None:
    await create_seed(api)
    assert api.dsv("dsv2-lite")["metadata"]["finalizers"] == [f"{GROUP}/finalizer"]  # type: ignore[index]
    await api.delete(f"/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}/dsv2-lite")
    await api.wait(lambda: api.dsv("dsv2-lite") is None, "the DisaggServing to be gone")
    assert api.children("dsv2-lite") == {}


async def test_operator_restart_duplicates_nothing_and_writes_nothing(
        cluster: Sandbox, api: Api, config: OperatorConfig) -> None:
    await create_seed(api)
    children = api.children("dsv2-lite")
    await cluster.stop_operator()
    mark = api.mark()
    await cluster.start_operator(config)
    await api.wait(lambda: reconciles("dsv2-lite") >= 2, "two reconciles after the restart")
    assert api.writes_since(mark) == []
    assert api.children("dsv2-lite") == children


async def test_refused_change_is_reported_and_nothing_is_half_applied(api: Api) -> None:
    await create_seed(api)
    before = api.children("dsv2-lite")
    # A new image for every workload plus an etcd volume size: the API server refuses to
    # change a StatefulSet's volumeClaimTemplates, so nothing may change at all.
    await api.patch_spec("dsv2-lite", {"image": "test/serving:2",
                                       "etcd": {"storageSize": "20Gi"}})
    cond = await api.wait_condition("dsv2-lite", "Ready", "False", "ApplyFailed")
    assert "StatefulSet/dsv2-lite-etcd" in cond["message"]
    assert "Forbidden" in cond["message"]
    assert api.condition("dsv2-lite", "Degraded")["reason"] == "ApplyFailed"  # type: ignore[index]
    await api.wait(lambda: api.events("ApplyFailed"), "an ApplyFailed event")
    after = api.children("dsv2-lite")
    for key, obj in before.items():
        assert after[key]["spec" if "spec" in obj else "data"] == \
            obj["spec" if "spec" in obj else "data"], key

    await api.patch_spec("dsv2-lite", {"etcd": {"storageSize": None}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=3)
    decode = api.get("deployments", "dsv2-lite-decode")
    assert decode["spec"]["template"]["spec"]["containers"][0]["image"] == "test/serving:2"  # type: ignore[index]


async def test_a_name_too_long_for_its_children_creates_no_children(api: Api) -> None:
    """The CRD's CEL rule caps the name; the emulator skips CEL, so the operator's own check
    is what stands between a long name and children whose names Kubernetes refuses."""
    body = example("llama-1p1d.yaml")
    name = "x" * (MAX_NAME_LENGTH + 1)
    body["metadata"]["name"] = name
    await api.create(body)
    cond = await api.wait_condition(name, "Ready", "False", "InvalidSpec")
    assert f"at most {MAX_NAME_LENGTH}" in cond["message"] and "metadata.name" in cond["message"]
    assert api.children(name) == {}


async def test_an_operator_watching_one_namespace_reconciles_it(
        tmp_path, config: OperatorConfig) -> None:
    """`disagg-operator run --namespace default`: kopf lists Namespaces in that mode, which
    the emulator answered with a 500, so nothing was ever reconciled."""
    from disagg_devtools.emulator.sandbox import sandbox

    from .conftest import Api

    async with sandbox(tmp_path / "scoped") as box:
        await box.start_operator(config, namespaces=(NAMESPACE,))
        api = Api(box)
        await create_seed(api)
        await box.stop_operator()


async def test_a_crashing_instance_is_quoted_in_degraded(cluster: Sandbox, api: Api) -> None:
    """A serving pod whose container keeps failing at start (e.g. the connector refusing its
    configuration) is named in Degraded with the end of its log, not only in pod logs."""
    import kmock

    await create_seed(api)
    pods = kmock.resource("", "v1", "pods")
    cluster.emulator.objects[pods, NAMESPACE, "dsv2-lite-prefill-x1"] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "dsv2-lite-prefill-x1", "namespace": NAMESPACE, "labels": {
            "app.kubernetes.io/instance": "dsv2-lite",
            "app.kubernetes.io/managed-by": "disagg-operator",
            "app.kubernetes.io/component": "prefill"}},
        "status": {"containerStatuses": [{
            "name": "vllm", "restartCount": 2,
            "lastState": {"terminated": {"exitCode": 1, "message": "ValueError: "
                                         "kv_connector_extra_config.load_async must be true "
                                         "or false, not 'yes'"}}}]}}
    cond = await api.wait_condition("dsv2-lite", "Degraded", "True", "InstancesFailing")
    assert "load_async must be true or false" in cond["message"]


async def test_a_kv_change_rolls_prefill_and_decode_side_by_side(cluster: Sandbox,
                                                                 api: Api) -> None:
    """A block size change rewrites both vLLM Deployments in one reconcile (nothing deleted,
    nothing else written) to surge beside the old pods, each new pod gated on a registered peer
    of the new fingerprint; Progressing counts old and new instances per role until only new
    ones remain."""
    import kmock
    from disagg_operator.plan import ANNOTATION_COMPAT

    await create_seed(api)
    old_compat = api.get("deployments", "dsv2-lite-prefill")[  # type: ignore[index]
        "spec"]["template"]["metadata"]["annotations"][ANNOTATION_COMPAT]
    cluster.emulator.readiness = "manual"
    mark = api.mark()
    await api.patch_spec("dsv2-lite", {"model": {"blockSize": 32}})
    await api.wait_condition("dsv2-lite", "Progressing", "True", "RollingOut", generation=2)
    child_writes = [w for w in api.writes_since(mark) if PLURAL not in w]
    assert child_writes == [
        f"PATCH /apis/apps/v1/namespaces/default/deployments/dsv2-lite-{role}"
        for role in ("prefill", "decode")]
    new_compat = ""
    for role, peer in (("prefill", "decode"), ("decode", "prefill")):
        workload = api.get("deployments", f"dsv2-lite-{role}")["spec"]  # type: ignore[index]
        assert workload["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        template = workload["template"]
        new_compat = template["metadata"]["annotations"][ANNOTATION_COMPAT]
        assert "blockSize=32" in new_compat and new_compat != old_compat
        registrar = next(c for c in template["spec"]["containers"] if c["name"] == "registrar")
        gate = registrar["startupProbe"]["exec"]["command"]
        fingerprint = registrar["args"][registrar["args"].index("--fingerprint") + 1]
        assert gate[gate.index("--peer-role") + 1] == peer
        assert gate[gate.index("--fingerprint") + 1] == fingerprint

    pods = kmock.resource("", "v1", "pods")

    def pod(role: str, index: int, compat: str, ready: bool) -> None:
        name = f"dsv2-lite-{role}-{compat == new_compat and 'new' or 'old'}{index}"
        cluster.emulator.objects[pods, NAMESPACE, name] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE,
                         "annotations": {ANNOTATION_COMPAT: compat}, "labels": {
                             "app.kubernetes.io/instance": "dsv2-lite",
                             "app.kubernetes.io/managed-by": "disagg-operator",
                             "app.kubernetes.io/component": role}},
            "status": {"conditions": [{"type": "Ready", "status": str(ready)}]}}

    pod("prefill", 0, old_compat, True)
    pod("decode", 0, old_compat, True)
    pod("decode", 1, old_compat, True)
    pod("prefill", 0, new_compat, True)
    pod("decode", 0, new_compat, False)
    cond = await api.wait_condition("dsv2-lite", "Progressing", "True", "KVRollout")
    assert cond["message"].endswith(
        "prefill 1 new (1 ready), 1 old; decode 1 new (0 ready), 2 old"), cond["message"]
    # The old pods go (their Deployment's controller retires them for ready new ones).
    for name in ("dsv2-lite-prefill-old0", "dsv2-lite-decode-old0", "dsv2-lite-decode-old1"):
        del cluster.emulator.objects[pods, NAMESPACE, name]
    for role in ("prefill", "decode"):
        await cluster.emulator.set_workload_ready("deployments", NAMESPACE,
                                                  f"dsv2-lite-{role}")
    await api.wait_condition("dsv2-lite", "Progressing", "False", "RolloutComplete",
                             generation=2)


async def test_an_object_the_operator_does_not_own_is_never_taken_over(cluster, api) -> None:
    """A user's ConfigMap that has a child's name: the operator used to force-apply over it,
    and deleting the DisaggServing then garbage-collected the user's object. It now leaves it
    as it is, says which object is in the way, and goes on once it is gone."""
    mine = {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "dsv2-lite-config", "namespace": NAMESPACE},
            "data": {"owner": "a user"}}
    await api._request("POST", f"/api/v1/namespaces/{NAMESPACE}/configmaps", mine)
    await api.create(example("deepseek-v2-lite-1p2d.yaml"))
    cond = await api.wait_condition("dsv2-lite", "Degraded", "True", "Conflict")
    assert "ConfigMap dsv2-lite-config" in cond["message"], cond
    theirs = api.get("configmaps", "dsv2-lite-config", group="") or {}
    assert theirs.get("data") == {"owner": "a user"}, theirs
    assert not theirs["metadata"].get("ownerReferences"), theirs
    assert api.condition("dsv2-lite", "Ready")["status"] == "False"
    await api.delete(f"/api/v1/namespaces/{NAMESPACE}/configmaps/dsv2-lite-config")
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady")
    ours = api.get("configmaps", "dsv2-lite-config", group="") or {}
    assert ours["metadata"]["ownerReferences"][0]["kind"] == "DisaggServing"


async def test_a_missing_etcd_tls_secret_is_named_in_the_status(cluster: Sandbox,
                                                                api: Api) -> None:
    """The kubelet names a missing Secret volume only in a FailedMount Event (no kubelet runs
    here: the test writes the pod state and the Event as it would); the status names it."""
    import kmock

    await api.create(example("deepseek-v2-lite-etcd-tls.yaml"))
    await api.wait(lambda: api.children("dsv2-lite-tls"), "the children")
    pod, secret = "dsv2-lite-tls-prefill-x1", "dsv2-lite-tls-etcd-client"
    cluster.emulator.objects[kmock.resource("", "v1", "pods"), NAMESPACE, pod] = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": pod, "namespace": NAMESPACE, "labels": {
            "app.kubernetes.io/instance": "dsv2-lite-tls",
            "app.kubernetes.io/managed-by": "disagg-operator",
            "app.kubernetes.io/component": "prefill"}},
        "status": {"phase": "Pending", "containerStatuses": [{
            "name": "vllm", "restartCount": 0,
            "state": {"waiting": {"reason": "ContainerCreating"}}}]}}
    cluster.emulator.objects[kmock.resource("", "v1", "events"), NAMESPACE, f"{pod}.1"] = {
        "apiVersion": "v1", "kind": "Event", "type": "Warning", "reason": "FailedMount",
        "metadata": {"name": f"{pod}.1", "namespace": NAMESPACE},
        "involvedObject": {"kind": "Pod", "name": pod, "namespace": NAMESPACE},
        "message": f'MountVolume.SetUp failed for volume "etcd-client-tls" : secret '
                   f'"{secret}" not found'}
    cond = await api.wait_condition("dsv2-lite-tls", "Degraded", "True", "SecretMissing")
    assert f"Secret {secret} (named by spec.etcd.tls.clientSecret) does not exist" in \
        cond["message"]
    assert api.condition("dsv2-lite-tls", "Progressing")["reason"] == "SecretMissing"  # type: ignore[index]
