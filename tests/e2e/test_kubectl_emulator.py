"""The real kubectl against the API emulator serving our generated CRD."""

import asyncio
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import kmock
import pytest
from disagg_devtools.emulator.server import ClusterEmulator
from disagg_operator.crd import build_crd
from disagg_operator.status import Observation, compute_status

ROOT = Path(__file__).resolve().parents[2]
if shutil.which("kubectl") is None:  # a missing tool fails the run; it never skips
    pytest.fail("these tests run the real kubectl: install it (e.g. Debian's kubectl "
                "package) so that it is on PATH", pytrace=False)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[tuple[ClusterEmulator, dict[str, str]]]:
    async with ClusterEmulator() as emu, kmock.Server(emu) as server:
        emu.register_crd(build_crd())
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\n"
            f"clusters: [{{name: emu, cluster: {{server: '{server.url}'}}}}]\n"
            "users: [{name: u, user: {token: test}}]\n"
            "contexts: [{name: emu, context: {cluster: emu, user: u, namespace: default}}]\n"
            "current-context: emu\n")
        env = {**os.environ, "KUBECONFIG": str(kubeconfig),
               "KUBECACHEDIR": str(tmp_path / "cache"), "HOME": str(tmp_path)}
        yield emu, env


async def kubectl(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, ["kubectl", *args], env=env,
                                   capture_output=True, text=True, timeout=60)


async def test_apply_defaults_and_printer_columns(cluster) -> None:
    emu, env = cluster
    result = await kubectl(env, "apply", "-f", str(ROOT / "examples/deepseek-v2-lite-1p2d.yaml"))
    assert result.returncode == 0, result.stderr
    assert "created" in result.stdout
    got = await kubectl(env, "get", "disaggserving", "dsv2-lite", "-o",
                        "jsonpath={.spec.kvTransfer.connector} {.spec.prefill.replicas}")
    assert got.stdout == "MooncakeStore 1"  # CRD defaults applied at the API

    # Write a status as the operator would, then read it through the printer columns.
    key = (kmock.resource("serving.disagg.dev", "v1alpha1", "disaggservings"),
           "default", "dsv2-lite")
    obs = Observation(generation=1, desired=[], observed={}, etcd_mode="Managed",
                      etcd_endpoints=("e:2379",), etcd_health=None, endpoint="http://p:8000",
                      roles={})
    status = compute_status(obs, {}, "2026-01-01T00:00:00Z")
    status["prefill"] = {"replicas": 1, "readyReplicas": 1, "summary": "1/1"}
    status["decode"] = {"replicas": 2, "readyReplicas": 1, "summary": "1/2"}
    emu.objects[key].patch({"status": status})
    table = await kubectl(env, "get", "disaggservings")
    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split() == ["NAME", "READY", "PREFILL", "DECODE", "ENDPOINT", "AGE"]
    assert row.split()[:5] == ["dsv2-lite", "False", "1/1", "1/2", "http://p:8000"]


async def test_invalid_block_size_is_rejected_at_the_api(cluster, tmp_path: Path) -> None:
    _, env = cluster
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: serving.disagg.dev/v1alpha1\nkind: DisaggServing\n"
                   "metadata: {name: bad}\nspec:\n  model: {name: m, blockSize: 17}\n")
    result = await kubectl(env, "apply", "-f", str(bad))
    assert result.returncode != 0
    assert "spec.model.blockSize" in result.stderr
    listed = await kubectl(env, "get", "disaggservings", "-o", "name")
    assert "bad" not in listed.stdout


async def test_json_patches_are_validated_and_bump_the_generation(cluster) -> None:
    emu, env = cluster
    assert (await kubectl(env, "apply", "-f",
                          str(ROOT / "examples/deepseek-v2-lite-1p2d.yaml"))).returncode == 0

    async def generation() -> str:
        return (await kubectl(env, "get", "disaggserving", "dsv2-lite", "-o",
                              "jsonpath={.metadata.generation}")).stdout

    before = await generation()
    bad = await kubectl(env, "patch", "disaggserving", "dsv2-lite", "--type=json", "-p",
                        '[{"op": "replace", "path": "/spec/model/blockSize", "value": 17}]')
    assert bad.returncode != 0 and "spec.model.blockSize" in bad.stderr
    failed_test = await kubectl(env, "patch", "disaggserving", "dsv2-lite", "--type=json", "-p",
                                '[{"op": "test", "path": "/spec/decode/replicas", "value": 9},'
                                ' {"op": "replace", "path": "/spec/decode/replicas", "value": 3}]')
    assert failed_test.returncode != 0
    assert "the server rejected our request" in failed_test.stderr  # a 422, as kube answers
    assert await generation() == before
    good = await kubectl(env, "patch", "disaggserving", "dsv2-lite", "--type=json", "-p",
                         '[{"op": "replace", "path": "/spec/decode/replicas", "value": 3}]')
    assert good.returncode == 0, good.stderr
    assert int(await generation()) == int(before) + 1


async def test_events_are_selected_by_their_involved_object(cluster, tmp_path: Path) -> None:
    _, env = cluster
    events = tmp_path / "events.yaml"
    events.write_text("".join(
        "---\napiVersion: v1\nkind: Event\n"
        f"metadata: {{name: e-{name}, namespace: default}}\n"
        f"involvedObject: {{kind: DisaggServing, name: {name}, namespace: default}}\n"
        f"reason: Ready\nmessage: {name} is ready\ntype: Normal\n"
        for name in ("first", "second")))
    assert (await kubectl(env, "apply", "-f", str(events))).returncode == 0
    got = await kubectl(env, "get", "events", "--field-selector", "involvedObject.name=second",
                        "-o", "jsonpath={.items[*].message}")
    assert got.stdout == "second is ready", got.stderr
    got = await kubectl(env, "get", "events", "--field-selector",
                        "involvedObject.name!=second,type=Normal",
                        "-o", "jsonpath={.items[*].message}")
    assert got.stdout == "first is ready", got.stderr


async def test_kubectl_scale_writes_the_workloads_replicas(cluster, tmp_path: Path) -> None:
    _, env = cluster
    deployment = tmp_path / "web.yaml"
    deployment.write_text(
        "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: web, namespace: default}\n"
        "spec:\n  replicas: 1\n  selector: {matchLabels: {app: web}}\n  template:\n"
        "    metadata: {labels: {app: web}}\n"
        "    spec: {containers: [{name: web, image: nginx}]}\n")
    assert (await kubectl(env, "apply", "-f", str(deployment))).returncode == 0
    scaled = await kubectl(env, "scale", "deployment", "web", "--replicas=3")
    assert scaled.returncode == 0, scaled.stderr
    got = await kubectl(env, "get", "deployment", "web", "-o",
                        "jsonpath={.spec.replicas} {.metadata.generation}")
    assert got.stdout == "3 2"
    scale = await kubectl(env, "get", "deployment", "web", "--subresource=scale", "-o",
                          "jsonpath={.kind} {.spec.replicas} {.status.selector}")
    assert scale.stdout == "Scale 3 app=web", scale.stderr


async def test_kubectl_scale_on_a_disaggserving_scales_decode(cluster) -> None:
    """The CRD's scale subresource: kubectl scale (or an HPA aimed at the DisaggServing)
    writes spec.decode.replicas and reads the decode pods' selector from the status."""
    emu, env = cluster
    applied = await kubectl(env, "apply", "-f",
                            str(ROOT / "examples/deepseek-v2-lite-1p2d.yaml"))
    assert applied.returncode == 0, applied.stderr
    key = (kmock.resource("serving.disagg.dev", "v1alpha1", "disaggservings"),
           "default", "dsv2-lite")
    emu.objects[key].patch({"status": {"decode": {
        "replicas": 2, "selector": "app.kubernetes.io/component=decode"}}})
    scaled = await kubectl(env, "scale", "disaggserving", "dsv2-lite", "--replicas=4")
    assert scaled.returncode == 0, scaled.stderr
    got = await kubectl(env, "get", "dsv", "dsv2-lite", "-o",
                        "jsonpath={.spec.decode.replicas} {.spec.prefill.replicas}")
    assert got.stdout == "4 1"
    scale = await kubectl(env, "get", "dsv", "dsv2-lite", "--subresource=scale", "-o",
                          "jsonpath={.spec.replicas} {.status.replicas} {.status.selector}")
    assert scale.stdout == "4 2 app.kubernetes.io/component=decode", scale.stderr


async def test_kubectl_explain_reads_the_crd_schema(cluster) -> None:
    """InvalidSpec messages point users at `kubectl explain disaggserving.spec`."""
    _, env = cluster
    got = await kubectl(env, "explain", "disaggserving.spec.model.blockSize")
    assert got.returncode == 0, got.stderr
    assert "KV page size in tokens" in got.stdout and "FIELD: blockSize <integer>" in got.stdout


DEPLOYMENT = """apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: default, labels: {app: web}}
spec:
  replicas: REPLICAS
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: web, image: IMAGE}]}
"""


async def test_server_side_apply_merges_by_field_manager(cluster, tmp_path) -> None:
    """What kubectl (and the operator, and an HPA) meet on a real API server: an apply owns
    what it names; another manager changing an owned field conflicts unless forced; a field
    a manager stops applying goes only if no one else owns it."""
    _, env = cluster

    async def apply(manager: str, replicas: int | None, image: str = "a",
                    *flags: str) -> subprocess.CompletedProcess[str]:
        text = DEPLOYMENT.replace("IMAGE", image)
        text = text.replace("REPLICAS", str(replicas)) if replicas is not None else \
            text.replace("  replicas: REPLICAS\n", "")
        path = tmp_path / f"{manager}-{replicas}-{image}.yaml"
        path.write_text(text)
        return await kubectl(env, "apply", "--server-side", f"--field-manager={manager}",
                             "-f", str(path), *flags)

    async def replicas() -> str:
        got = await kubectl(env, "get", "deployment", "web", "-o",
                            "jsonpath={.spec.replicas}")
        return got.stdout

    assert (await apply("alice", 3)).returncode == 0
    conflict = await apply("bob", 5)
    assert conflict.returncode != 0 and "conflict" in conflict.stderr.lower(), conflict
    assert "alice" in conflict.stderr and ".spec.replicas" in conflict.stderr
    assert await replicas() == "3"
    assert (await apply("bob", 3)).returncode == 0  # the same value: shared, no conflict
    assert (await apply("alice", None)).returncode == 0
    assert await replicas() == "3"  # bob still owns it
    assert (await apply("bob", 7, "a", "--force-conflicts")).returncode == 0
    assert await replicas() == "7"
    assert (await apply("bob", None)).returncode == 0
    assert await replicas() == ""  # its last owner let go: removed
    managers = await kubectl(env, "get", "deployment", "web", "--show-managed-fields", "-o",
                             "jsonpath={.metadata.managedFields[*].manager}")
    assert set(managers.stdout.split()) == {"alice", "bob"}, managers.stdout


async def test_a_merge_patch_of_the_status_merges(cluster) -> None:
    emu, env = cluster
    result = await kubectl(env, "apply", "-f", str(ROOT / "examples/deepseek-v2-lite-1p2d.yaml"))
    assert result.returncode == 0, result.stderr
    for patch in ('{"status": {"endpoint": "http://p:8000", "observedGeneration": 1}}',
                  '{"status": {"endpoint": null}}'):
        done = await kubectl(env, "patch", "disaggserving", "dsv2-lite", "--subresource=status",
                             "--type=merge", "-p", patch)
        assert done.returncode == 0, done.stderr
    got = await kubectl(env, "get", "disaggserving", "dsv2-lite", "-o", "jsonpath={.status}")
    assert '"observedGeneration":1' in got.stdout and "endpoint" not in got.stdout, got.stdout


async def test_unknown_fields_are_refused_under_strict_validation_and_pruned_otherwise(
        cluster, tmp_path) -> None:
    """kubectl asks for fieldValidation=Strict: a misspelt field fails, naming it, as on a real
    API server; without it the field is pruned, never stored."""
    _, env = cluster
    text = (ROOT / "examples/deepseek-v2-lite-1p2d.yaml").read_text()
    path = tmp_path / "typo.yaml"
    path.write_text(text.replace("  decode:\n", "  decode:\n    replica: 3\n", 1))
    refused = await kubectl(env, "apply", "-f", str(path))
    assert refused.returncode != 0, refused.stdout
    assert 'unknown field "spec.decode.replica"' in refused.stderr, refused.stderr
    allowed = await kubectl(env, "apply", "--validate=false", "-f", str(path))
    assert allowed.returncode == 0, allowed.stderr
    got = await kubectl(env, "get", "disaggserving", "dsv2-lite", "-o", "jsonpath={.spec.decode}")
    assert "replica\"" not in got.stdout and '"replicas":2' in got.stdout, got.stdout


async def test_deleting_a_namespace_deletes_what_is_in_it(cluster, tmp_path) -> None:
    _, env = cluster
    assert (await kubectl(env, "create", "namespace", "team-a")).returncode == 0
    made = await kubectl(env, "-n", "team-a", "create", "configmap", "settings",
                         "--from-literal=a=b")
    assert made.returncode == 0, made.stderr
    gone = await kubectl(env, "delete", "namespace", "team-a")
    assert gone.returncode == 0, gone.stderr
    left = await kubectl(env, "-n", "team-a", "get", "configmaps", "-o", "name")
    assert "settings" not in left.stdout, left.stdout
