"""Render and CRD generation: pure functions, checked against committed files."""

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from disagg_operator import plan
from disagg_operator.association import Owner
from disagg_operator.crd import render_crd_yaml
from disagg_operator.render import render_spec as render
from disagg_operator.spec import InvalidSpecError, parse_spec, spec_warnings

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))
GOLDEN = ROOT / "tests" / "golden"


def _render(path: Path) -> list[dict]:
    doc = yaml.safe_load(path.read_text())
    owner = Owner(doc["metadata"]["name"], "default", "uid-0")
    return render(owner, parse_spec(doc["spec"]), "disagg-operator/serving:0.1.0",
                  operator_namespace="disagg-system")


def test_committed_crd_is_generated_from_spec_models() -> None:
    assert (ROOT / "crds" / "disaggserving.yaml").read_text() == render_crd_yaml()


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_render_matches_golden(example: Path) -> None:
    golden = GOLDEN / f"{example.stem}.yaml"
    rendered = yaml.safe_dump_all(_render(example), sort_keys=False)
    assert golden.read_text() == rendered, f"regenerate {golden} if the change is intended"


def test_prefill_and_decode_share_model_dtype_block_size_and_differ_in_role() -> None:
    objs = {o["metadata"]["name"]: o for o in _render(ROOT / "examples/deepseek-v2-lite-1p2d.yaml")
            if o["kind"] == "Deployment"}
    args = {r: objs[f"dsv2-lite-{r}"]["spec"]["template"]["spec"]["containers"][0]["args"]
            for r in ("prefill", "decode")}
    for flag in ("--model", "--dtype", "--block-size"):
        assert args["prefill"][args["prefill"].index(flag) + 1] == \
            args["decode"][args["decode"].index(flag) + 1]
    kv = {r: args[r][args[r].index("--kv-transfer-config") + 1] for r in args}
    assert '"kv_role":"kv_producer"' in kv["prefill"]
    assert '"kv_role":"kv_consumer"' in kv["decode"]
    assert objs["dsv2-lite-decode"]["spec"]["replicas"] == 2


def test_external_etcd_renders_no_managed_etcd() -> None:
    names = {o["metadata"]["name"] for o in _render(ROOT / "examples/external-etcd.yaml")}
    assert not any(n.startswith("shared-etcd-etcd") for n in names)
    managed = {o["metadata"]["name"] for o in _render(ROOT / "examples/deepseek-v2-lite-1p2d.yaml")}
    assert {"dsv2-lite-etcd", "dsv2-lite-etcd-client"} <= managed


def test_hf_token_comes_from_secret_and_never_appears_in_args() -> None:
    objs = _render(ROOT / "examples/llama-1p1d.yaml")
    prefill = next(o for o in objs if o["metadata"]["name"] == "llama-prefill"
                   and o["kind"] == "Deployment")
    container = prefill["spec"]["template"]["spec"]["containers"][0]
    token = next(e for e in container["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert not any("hf-token" in a or "HF_TOKEN" in a for a in container["args"])


@pytest.mark.parametrize("spec,field", [
    ({"model": {"name": "m"}, "etcd": {"mode": "External"}}, "etcd"),
    ({"model": {"name": "m", "blockSize": 17}}, "model.blockSize"),
    ({"model": {"name": "m"}, "decode": {"replicas": -1}}, "decode.replicas"),
    ({"model": {"name": "m"}, "prefil": {}}, "prefil"),
    ({}, "model"),
    ({"model": {"name": "m"}, "decode": {"extraArgs": ["--block-size=32"]}}, "decode.extraArgs"),
    ({"model": {"name": "m"}, "prefill": {"extraArgs": ["-pp", "2"]}}, "prefill.extraArgs"),
])
def test_invalid_specs_name_the_field(spec: dict, field: str) -> None:
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(spec)
    assert err.value.field == field


def test_pipeline_parallelism_is_refused_with_the_reason() -> None:
    with pytest.raises(InvalidSpecError, match="pipeline stages hold different layers"):
        parse_spec({"model": {"name": "m"},
                    "decode": {"extraArgs": ["--pipeline_parallel_size=2"]}})


def test_mooncake_config_sizes_are_bytes() -> None:
    spec = parse_spec({"model": {"name": "m"}})
    text = plan.mooncake_config_json(spec, "master:50051", ("etcd:2379",))
    assert '"global_segment_size": 4294967296' in text
    assert '"metadata_server": "etcd://etcd:2379"' in text


def test_the_longest_allowed_name_gives_children_dns_label_names() -> None:
    from disagg_operator.association import DNS_LABEL_MAX, MAX_NAME_LENGTH, name_problem

    doc = yaml.safe_load((ROOT / "examples" / "deepseek-v2-lite-1p2d.yaml").read_text())
    name = "n" * MAX_NAME_LENGTH
    objects = render(Owner(name, "default", "uid-0"), parse_spec(doc["spec"]), "img:1")
    longest = max(len(o["metadata"]["name"]) for o in objects)
    assert longest == DNS_LABEL_MAX  # the limit is tight: one character more would not fit
    assert name_problem(name) is None and "at most 47" in (name_problem(name + "n") or "")


def test_a_config_file_change_rolls_the_pods_that_read_it() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "deepseek-v2-lite-1p2d.yaml").read_text())

    def templates(segment: str) -> dict[str, dict]:
        doc["spec"].setdefault("kvTransfer", {}).setdefault("mooncake", {})[
            "globalSegmentSize"] = segment
        objects = render(Owner("x", "default", "uid-0"), parse_spec(doc["spec"]), "img:1")
        return {o["metadata"]["name"]: o["spec"]["template"] for o in objects
                if o["kind"] == "Deployment"}

    before, after = templates("4Gi"), templates("8Gi")
    changed = {name for name in before if before[name] != after[name]}
    assert changed == {"x-prefill", "x-decode", "x-proxy"}  # the pods that mount mooncake.json
    key = "serving.disagg.dev/config-hash"
    assert before["x-prefill"]["metadata"]["annotations"][key] != \
        after["x-prefill"]["metadata"]["annotations"][key]


def test_the_kv_cache_dtype_is_the_operators_and_the_same_on_both_roles() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "deepseek-v2-lite-1p2d.yaml").read_text())
    with pytest.raises(InvalidSpecError, match="spec.model.kvCacheDtype"):
        parse_spec({**doc["spec"], "decode": {"extraArgs": ["--kv-cache-dtype=fp8"]}})
    auto = plan.compatibility_fingerprint(parse_spec(doc["spec"]))
    doc["spec"]["model"]["kvCacheDtype"] = "fp8"
    spec = parse_spec(doc["spec"])
    for role in ("prefill", "decode"):
        args = plan.vllm_args(role, spec)
        assert args[args.index("--kv-cache-dtype") + 1] == "fp8"
    assert plan.compatibility_fingerprint(spec) != auto  # fp8 pages never meet bf16 ones


def test_api_keys_reach_the_pods_only_as_secret_references() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "deepseek-v2-lite-1p2d.yaml").read_text())
    doc["spec"]["vllmApiKeySecret"] = {"name": "serving-keys", "key": "vllm"}
    doc["spec"]["proxy"] = {"apiKeySecret": {"name": "serving-keys", "key": "clients"}}
    objects = render(Owner("x", "default", "u"), parse_spec(doc["spec"]), "img:1")
    env = {o["metadata"]["name"]: {e["name"]: e for e in
                                   o["spec"]["template"]["spec"]["containers"][0]["env"]}
           for o in objects if o["kind"] == "Deployment"}
    ref = {"secretKeyRef": {"name": "serving-keys", "key": "vllm"}}
    assert env["x-prefill"]["VLLM_API_KEY"]["valueFrom"] == ref
    assert env["x-decode"]["VLLM_API_KEY"]["valueFrom"] == ref
    assert env["x-proxy"]["DISAGG_PROXY_BACKEND_API_KEY"]["valueFrom"] == ref
    assert env["x-proxy"]["DISAGG_PROXY_API_KEY"]["valueFrom"] == {
        "secretKeyRef": {"name": "serving-keys", "key": "clients"}}
    assert "serving-keys" not in yaml.safe_dump(
        [c["args"] for o in objects if o["kind"] == "Deployment"
         for c in o["spec"]["template"]["spec"]["containers"]])


@pytest.mark.parametrize("prefill_tp,decode_tp,extra,field", [
    (3, 2, {}, "spec.prefill.tensorParallelSize"),  # 3 does not split 8 heads
    (2, 2, {"store_tp_size": 3}, "spec.kvTransfer.extraConfig.store_tp_size"),
    (4, 2, {}, None),  # store_tp_size 4: shards of 2 heads, inside one rank of each
    (1, 2, {"store_tp_size": 16}, None),  # capped at the 8 heads
])
def test_tp_sizes_and_store_shards_are_checked_against_the_kv_heads(
        prefill_tp: int, decode_tp: int, extra: dict, field: str | None) -> None:
    doc = yaml.safe_load((ROOT / "examples" / "llama-1p1d.yaml").read_text())
    spec = {**doc["spec"], "model": {**doc["spec"]["model"], "kvHeads": 8},
            "prefill": {"tensorParallelSize": prefill_tp},
            "decode": {"tensorParallelSize": decode_tp},
            "kvTransfer": {"extraConfig": extra}}
    if field is None:
        parse_spec(spec)
        return
    with pytest.raises(InvalidSpecError) as err:
        parse_spec(spec)
    assert str(err.value).startswith(field) and "8 KV heads" in str(err.value)
    spec["model"].pop("kvHeads")  # without the head count the operator cannot tell...
    (warning,) = spec_warnings(parse_spec(spec))  # ...and says so
    assert warning.reason == "KVHeadsUnset" and "set model.kvHeads" in warning.message


def test_a_spec_with_nothing_to_check_has_no_warning_and_mla_sets_one_head() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "llama-1p1d.yaml").read_text())
    doc["spec"]["model"].pop("kvHeads")
    assert spec_warnings(parse_spec(doc["spec"])) == []  # TP 1 everywhere: nothing to check
    tp16 = yaml.safe_load((ROOT / "examples" / "deepseek-v3-tp16.yaml").read_text())["spec"]
    assert tp16["model"]["kvHeads"] == 1 and spec_warnings(parse_spec(tp16)) == []


def test_decode_saving_is_set_on_decode_only() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    spec = parse_spec({**doc["spec"], "kvTransfer": {"saveDecodeCache": True}})
    assert plan.kv_transfer_config("decode", spec)["kv_connector_extra_config"][
        "save_decode_cache"] is True
    assert "save_decode_cache" not in plan.kv_transfer_config(
        "prefill", spec)["kv_connector_extra_config"]


def test_leaving_vllm_instances_drain_within_their_roles_grace_period() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "deepseek-v2-lite-1p2d.yaml").read_text())
    doc["spec"]["decode"]["terminationGracePeriodSeconds"] = 900
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"]
            for o in render(Owner("x", "default", "uid-0"), parse_spec(doc["spec"]), "img:1")
            if o["kind"] == "Deployment"}
    for name, grace in (("x-prefill", 300), ("x-decode", 900)):
        pod = pods[name]
        assert pod["terminationGracePeriodSeconds"] == grace
        vllm, registrar = pod["containers"]
        hook = vllm["lifecycle"]["preStop"]["exec"]["command"]
        assert hook[1:3] == ["-m", "kvhelper.drain"]
        assert float(hook[hook.index("--timeout") + 1]) < grace
        # The registrar has no hook: it gets SIGTERM at once and withdraws the instance.
        assert "lifecycle" not in registrar
    assert "terminationGracePeriodSeconds" not in pods["x-proxy"]
    with pytest.raises(InvalidSpecError, match="terminationGracePeriodSeconds"):
        parse_spec({**doc["spec"], "prefill": {"terminationGracePeriodSeconds": 5}})


def test_an_externally_scaled_role_leaves_its_replicas_to_the_scaler() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    workloads = {
        mode: {o["metadata"]["name"]: o["spec"] for o in render(
            Owner("x", "default", "uid-0"),
            parse_spec({**doc["spec"], "autoscaling": {"mode": mode}}), "img:1")
            if o["kind"] == "Deployment"}
        for mode in ("Off", "External")}
    assert workloads["Off"]["x-decode"]["replicas"] == 2
    # Not in the applied manifest, so not owned by the operator: an HPA's count stays.
    assert "replicas" not in workloads["External"]["x-decode"]
    assert "replicas" not in workloads["External"]["x-prefill"]
    assert workloads["External"]["x-proxy"]["replicas"] == 1


def test_store_pods_hold_the_pool_and_engines_lend_nothing() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(
        Owner("x", "default", "uid-0"),
        parse_spec({**doc["spec"], "store": {"replicas": 2, "segmentSize": "1Gi"}}), "img:1")}
    store = objects[("Deployment", "x-store")]
    assert store["spec"]["replicas"] == 2
    (container,) = store["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mooncake_client"]
    assert "--global_segment_size=1073741824" in container["args"]
    assert "--master_server_address=x-mooncake-master.default.svc.cluster.local:50051" in \
        container["args"]
    assert container["resources"]["limits"]["memory"] == "1536Mi"  # the segment + 512Mi
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    assert ("Service", "x-store") not in objects  # found through the master, not DNS
    config = json.loads(objects[("ConfigMap", "x-config")]["data"]["mooncake.json"])
    assert config["global_segment_size"] == 0
    without = render(Owner("x", "default", "uid-0"), parse_spec(doc["spec"]), "img:1")
    config = json.loads(next(o for o in without if o["kind"] == "ConfigMap")["data"][
        "mooncake.json"])
    assert config["global_segment_size"] == 256 << 20
    with pytest.raises(InvalidSpecError, match="spec.store.replicas"):
        parse_spec({**doc["spec"], "store": {"replicas": 1},
                    "kvTransfer": {"connector": "NixlConnector"}})


def test_masters_in_ha_mode_elect_a_leader_that_clients_find_through_etcd() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    objects = {(o["kind"], o["metadata"]["name"]): o for o in render(
        Owner("x", "ns", "uid-0"), parse_spec({**doc["spec"], "mooncakeMaster": {"replicas": 3},
                                                "store": {"replicas": 1}}), "img:1")}
    master = objects[("Deployment", "x-mooncake-master")]
    assert master["spec"]["replicas"] == 3
    (container,) = master["spec"]["template"]["spec"]["containers"]
    etcd = "x-etcd-client.ns.svc.cluster.local:2379"
    for arg in ("--enable_ha=true", f"--etcd_endpoints={etcd}", "--cluster_id=ns.x",
                "--rpc_address=$(POD_IP)"):
        assert arg in container["args"]
    # Leader or standby, a running master is ready: /health on the admin (metrics) port.
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "metrics"}
    config = json.loads(objects[("ConfigMap", "x-config")]["data"]["mooncake.json"])
    assert config["master_server_address"] == f"etcd://{etcd}"
    for workload in ("x-prefill", "x-decode", "x-proxy", "x-store"):
        env = objects[("Deployment", workload)]["spec"]["template"]["spec"]["containers"][0][
            "env"]
        assert {"name": "MC_STORE_CLUSTER_ID", "value": "ns.x"} in env, workload
    store = objects[("Deployment", "x-store")]["spec"]["template"]["spec"]["containers"][0]
    assert f"--master_server_address=etcd://{etcd}" in store["args"]


def _pods(spec: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Pod templates by workload (a LeaderWorkerSet's as NAME/leader and NAME/worker)."""
    pods = {}
    for obj in render(Owner("x", "default", "uid-0"), parse_spec(spec), "img:1"):
        if obj["kind"] == "Deployment":
            pods[obj["metadata"]["name"]] = obj["spec"]["template"]
        if obj["kind"] == "LeaderWorkerSet":
            group = obj["spec"]["leaderWorkerTemplate"]
            pods[f"{obj['metadata']['name']}/leader"] = group["leaderTemplate"]
            pods[f"{obj['metadata']['name']}/worker"] = group["workerTemplate"]
    return pods


def test_rdma_host_network_and_interfaces_reach_the_vllm_and_store_pods() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "tiny-mla-1p2d.yaml").read_text())
    networks = {"k8s.v1.cni.cncf.io/networks": "rdma-net"}
    pods = _pods({**doc["spec"], "store": {"replicas": 1},
                  "kvTransfer": {"mooncake": {"protocol": "rdma", "devices": "mlx5_0",
                                              "rdmaResource": "rdma/hca"}},
                  "podNetwork": {"hostNetwork": True, "annotations": networks,
                                 "socketInterface": "net1"},
                  "decode": {"sharedMemorySize": "16Gi"}})
    for name in ("x-prefill", "x-decode", "x-store"):
        spec = pods[name]["spec"]
        main = spec["containers"][0]
        assert main["resources"]["limits"]["rdma/hca"] == 1, name
        assert main["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"], name
        assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
        assert pods[name]["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    env = {e["name"]: e.get("value") for e in pods["x-decode"]["spec"]["containers"][0]["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "net1"
    shm = next(v for v in pods["x-decode"]["spec"]["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    proxy = pods["x-proxy"]["spec"]
    assert "hostNetwork" not in proxy and "rdma/hca" not in str(proxy)
    with pytest.raises(InvalidSpecError, match="kvTransfer.mooncake.rdmaResource"):
        parse_spec({**doc["spec"], "kvTransfer": {"mooncake": {"rdmaResource": "rdma/hca"}}})


def test_placement_gang_labels_exclusive_topology_and_decode_near_prefill() -> None:
    doc = yaml.safe_load((ROOT / "examples" / "deepseek-v3-tp16.yaml").read_text())
    gang = {"spec": {"schedulerName": "volcano"}, "metadata": {
        "annotations": {"scheduling.k8s.io/group-name": "dsv3"},
        "labels": {"kueue.x-k8s.io/queue-name": "inference"}}}
    spec = {**doc["spec"],
            "prefill": {**doc["spec"]["prefill"], "exclusiveTopology": "nvidia.com/gpu.clique",
                        "podTemplate": gang},
            "decode": {**doc["spec"]["decode"], "affinityToPrefill": {
                "topologyKey": "topology.kubernetes.io/zone", "required": True}}}
    objects = {o["metadata"]["name"]: o for o in render(
        Owner("x", "default", "uid-0"), parse_spec(spec), "img:1")
        if o["kind"] == "LeaderWorkerSet"}
    assert objects["x-prefill"]["metadata"]["annotations"] == {
        "leaderworkerset.sigs.k8s.io/exclusive-topology": "nvidia.com/gpu.clique"}
    pods = _pods(spec)
    for part in ("leader", "worker"):  # a gang is the whole group
        pod = pods[f"x-prefill/{part}"]
        assert pod["spec"]["schedulerName"] == "volcano"
        assert pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "inference"
        assert pod["metadata"]["annotations"]["scheduling.k8s.io/group-name"] == "dsv3"
        decode = pods[f"x-decode/{part}"]["spec"]["affinity"]["podAffinity"]
        (term,) = decode["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term["topologyKey"] == "topology.kubernetes.io/zone"
        assert term["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    assert "schedulerName" not in pods["x-decode/leader"]["spec"]  # set per role
    with pytest.raises(InvalidSpecError, match="prefill.affinityToPrefill"):
        parse_spec({**spec, "prefill": {"affinityToPrefill": {"topologyKey": "k"}}})
    with pytest.raises(InvalidSpecError, match="decode.exclusiveTopology"):
        parse_spec({**doc["spec"], "decode": {"exclusiveTopology": "rack"}})


def test_etcd_tls_mounts_each_secret_only_where_it_is_used() -> None:
    """The server Secret in etcd only, the client Secret in the registrars and the proxy only;
    the Secrets' contents never reach an argument or an env value."""
    objects = _render(ROOT / "examples" / "deepseek-v2-lite-etcd-tls.yaml")
    mounted: dict[str, set[str]] = {}
    for obj in objects:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = obj["spec"]["template"]["spec"]
        secrets = {v["name"]: v["secret"]["secretName"] for v in pod.get("volumes", [])
                   if "secret" in v}
        for container in pod["containers"]:
            for mount in container.get("volumeMounts", []):
                if mount["name"] in secrets:
                    assert mount["readOnly"] is True
                    mounted.setdefault(secrets[mount["name"]], set()).add(
                        f"{obj['metadata']['name']}/{container['name']}")
    assert mounted == {
        "dsv2-lite-tls-etcd-server": {"dsv2-lite-tls-etcd/etcd"},
        "dsv2-lite-tls-etcd-client": {"dsv2-lite-tls-prefill/registrar",
                                      "dsv2-lite-tls-decode/registrar",
                                      "dsv2-lite-tls-proxy/proxy"}}


@pytest.mark.parametrize(("change", "field"), [
    ({"etcd": {"tls": {"clientSecret": "c"}}}, "etcd.tls.serverSecret"),
    ({"etcd": {"mode": "External", "endpoints": ["e:2379"],
               "tls": {"clientSecret": "c", "serverSecret": "s"}}}, "etcd.tls.serverSecret"),
    ({"etcd": {"tls": {"clientSecret": "c", "serverSecret": "s"}}},
     "kvTransfer.mooncake.metadataBackend"),
    ({"etcd": {"tls": {"clientSecret": "c", "serverSecret": "s"}},
      "kvTransfer": {"mooncake": {"metadataBackend": "P2PHANDSHAKE"}},
      "mooncakeMaster": {"replicas": 2}}, "mooncakeMaster.replicas"),
])
def test_etcd_tls_refuses_what_cannot_use_it(change: dict[str, object], field: str) -> None:
    with pytest.raises(InvalidSpecError, match=f"^spec.{field}: "):
        parse_spec({"model": {"name": "m"}, **change})


def _all_pod_specs(objs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    pods = {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in objs
            if o["kind"] in ("Deployment", "StatefulSet")}
    for obj in objs:
        if obj["kind"] == "LeaderWorkerSet":
            group = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                pods[f"{obj['metadata']['name']}/{part}"] = group[part]["spec"]
    return pods


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_every_read_only_root_has_a_writable_tmp(example: Path) -> None:
    """Python's tempfile, torch, Hugging Face and glog write under /tmp; a read-only root
    without a volume there stops the proxy at import (found running the pods in podman)."""
    for name, pod in _all_pod_specs(_render(example)).items():
        volumes = {v["name"]: v for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            if not container["securityContext"]["readOnlyRootFilesystem"]:
                continue
            tmp = [m for m in container.get("volumeMounts", []) if m["mountPath"] == "/tmp"]
            assert tmp, f"{name}/{container['name']}: read-only root and no /tmp volume"
            assert "emptyDir" in volumes[tmp[0]["name"]] and not tmp[0].get("readOnly")


def test_a_model_on_a_claim_reaches_the_proxys_tokenizer_read_only() -> None:
    """model.name may be a path on the model claim; the proxy tokenizes with it (store-aware
    routing), so it mounts the claim too, read-only, at the same path."""
    doc = yaml.safe_load((ROOT / "examples/tiny-mla-1p2d.yaml").read_text())
    doc["spec"]["model"].update(name="/models/tiny-mla",
                                cache={"pvcClaimName": "models", "mountPath": "/models"})
    pods = _pods(doc["spec"])
    proxy = pods["x-proxy"]["spec"]
    args = proxy["containers"][0]["args"]
    assert args[args.index("--tokenizer") + 1] == "/models/tiny-mla"
    mount = next(m for m in proxy["containers"][0]["volumeMounts"]
                 if m["mountPath"] == "/models")
    volume = next(v for v in proxy["volumes"] if v["name"] == mount["name"])
    assert mount["readOnly"] is True
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    decode = pods["x-decode"]["spec"]
    assert any(v.get("persistentVolumeClaim", {}).get("claimName") == "models"
               for v in decode["volumes"])
