"""What we ship, checked by the community's tools: kubernetes-validate (strict, current
Kubernetes schemas), checkov, yamllint and hadolint. Accepted checkov findings are listed with
the reason; any other finding fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from disagg_devtools.emulator.helm import CHART

from .conftest import ROOT, run

GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.yaml"))
KUBERNETES_VERSION = "1.32.0"

# checkov findings we accept, and why. Scoped by check id; reviewed when this list changes.
ACCEPTED = {
    "CKV_K8S_21": "goldens are rendered into the example's `default` namespace; users choose",
    "CKV_K8S_43": "images are referenced by tag; users may give a digest in spec.image",
    "CKV_K8S_15": "imagePullPolicy is the user's choice (spec.imagePullPolicy); IfNotPresent "
                  "avoids pulling multi-GB vLLM images on every restart",
    "CKV_K8S_11": "no CPU limits on purpose: CFS throttling adds tail latency to serving",
    "CKV_K8S_10": "vLLM containers are sized per model by spec.prefill/decode.resources "
                  "(default: GPUs only); every other container has requests",
    "CKV_K8S_12": "as CKV_K8S_10, for memory requests of vLLM containers",
    "CKV_K8S_13": "as CKV_K8S_10, for memory limits of vLLM containers",
    "CKV_K8S_40": "serving pods run as uid 1000, the serving image's user (non-root)",
    "CKV_K8S_22": "vLLM/torch write caches under $HOME and /tmp at run time; the vLLM "
                  "container's root filesystem stays writable (all other containers: read-only)",
    "CKV_K8S_35": "HF_TOKEN is read from the environment by huggingface_hub; it comes from a "
                  "secretKeyRef, never a literal",
    "CKV_K8S_8": "the registrar sidecar serves no HTTP endpoint yet (issue 5); vLLM has probes",
    "CKV_K8S_9": "as CKV_K8S_8",
    "CKV_K8S_116": "managed etcd runs without TLS inside the cluster (TLS is not implemented "
                   "yet); use an external etcd with TLS where that matters",
    "CKV_K8S_117": "as CKV_K8S_116",
    "CKV_K8S_119": "as CKV_K8S_116",
    "CKV_K8S_38": "the operator's pod mounts its service account token: it talks to the API "
                  "(every serving pod has automountServiceAccountToken: false)",
}


# The LeaderWorkerSet API (leaderworkerset.x-k8s.io/v1) as its documentation gives it, for the
# fields the operator renders; the pod templates inside are checked as core PodTemplates.
LEADER_WORKER_SET_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "leaderworkerset.x-k8s.io/v1"},
        "kind": {"const": "LeaderWorkerSet"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "required": ["leaderWorkerTemplate"],
            "properties": {
                "replicas": {"type": "integer", "minimum": 0},
                "startupPolicy": {"enum": ["LeaderCreated", "LeaderReady"]},
                "rolloutStrategy": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "type": {"enum": ["RollingUpdate"]},
                        "rollingUpdateConfiguration": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"maxUnavailable": {"type": ["integer", "string"]},
                                           "maxSurge": {"type": ["integer", "string"]}}}}},
                "leaderWorkerTemplate": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["workerTemplate"],
                    "properties": {
                        "size": {"type": "integer", "minimum": 1},
                        "restartPolicy": {"enum": ["RecreateGroupOnPodRestart", "Default",
                                                   "None"]},
                        "leaderTemplate": {"type": "object"},
                        "workerTemplate": {"type": "object"},
                        "subGroupPolicy": {"type": "object"},
                    },
                },
                "networkConfig": {"type": "object"},
            },
        },
    },
}


def core_objects(tmp: Path) -> Path:
    """The goldens' objects the core schemas cover: LeaderWorkerSets are checked against
    LEADER_WORKER_SET_SCHEMA, and their pod templates become core PodTemplates."""
    import jsonschema
    import yaml

    core = []
    for path in GOLDEN:
        for obj in yaml.safe_load_all(path.read_text()):
            if obj["kind"] != "LeaderWorkerSet":
                core.append(obj)
                continue
            jsonschema.validate(obj, LEADER_WORKER_SET_SCHEMA)
            group = obj["spec"]["leaderWorkerTemplate"]
            for part in ("leaderTemplate", "workerTemplate"):
                core.append({"apiVersion": "v1", "kind": "PodTemplate",
                             "metadata": {"name": f"{obj['metadata']['name']}-{part.lower()}",
                                          "namespace": obj["metadata"]["namespace"]},
                             "template": group[part]})
    out = tmp / "core.yaml"
    out.write_text(yaml.safe_dump_all(core, sort_keys=False))
    return out


def test_rendered_children_and_crd_validate_strictly(tools: Path, tmp_path: Path) -> None:
    result = run(tools / "kubernetes-validate", "--strict", "--quiet", "-k", KUBERNETES_VERSION,
                 core_objects(tmp_path), ROOT / "crds" / "disaggserving.yaml")
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_leader_worker_set_outside_its_documented_api_is_refused(tmp_path: Path) -> None:
    import jsonschema
    import yaml

    lws = next(o for o in yaml.safe_load_all((ROOT / "tests/golden/kimi-k2.yaml").read_text())
               if o["kind"] == "LeaderWorkerSet")
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "Always"  # not an LWS policy
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(lws, LEADER_WORKER_SET_SCHEMA)


def test_chart_manifests_validate_strictly(tools: Path, chart_manifests: Path) -> None:
    result = run(tools / "kubernetes-validate", "--strict", "--quiet", "-k", KUBERNETES_VERSION,
                 chart_manifests)
    assert result.returncode == 0, result.stdout + result.stderr


def checkov_failures(tools: Path, *paths: Path) -> dict[str, set[str]]:
    args: list[str | Path] = [tools / "checkov", "--framework", "kubernetes", "--skip-download",
                              "--quiet", "--compact", "-o", "json"]
    for path in paths:
        args += ["-f", path]
    result = run(*args, timeout=600)
    reports = json.loads(result.stdout)
    failed: dict[str, set[str]] = {}
    for report in reports if isinstance(reports, list) else [reports]:
        for check in report.get("results", {}).get("failed_checks", []):
            failed.setdefault(check["check_id"], set()).add(check["resource"])
    return failed


@pytest.mark.parametrize("what", ["children", "chart"])
def test_checkov_finds_only_accepted_issues(tools: Path, chart_manifests: Path,
                                            what: str) -> None:
    paths = GOLDEN if what == "children" else [chart_manifests]
    failed = checkov_failures(tools, *paths)
    unexpected = {check: sorted(res) for check, res in failed.items() if check not in ACCEPTED}
    assert unexpected == {}


def test_chart_has_no_accepted_findings_beyond_images(tools: Path,
                                                      chart_manifests: Path) -> None:
    """The operator's own Deployment meets a stricter bar: only image pinning, CPU limits and
    its (needed) API token are waived."""
    failed = checkov_failures(tools, chart_manifests)
    assert set(failed) <= {"CKV_K8S_43", "CKV_K8S_15", "CKV_K8S_11", "CKV_K8S_38"}, failed


def test_yamllint(tools: Path) -> None:
    files = [*sorted((ROOT / "examples").glob("*.yaml")), ROOT / "crds" / "disaggserving.yaml",
             CHART / "Chart.yaml", CHART / "values.yaml", ROOT / ".yamllint.yaml"]
    result = run(tools / "yamllint", "-c", ROOT / ".yamllint.yaml", *files)
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("dockerfile", [
    "Dockerfile", "docker/bases/vllm-cpu.Dockerfile", "docker/bases/etcd.Dockerfile"])
def test_hadolint(tools: Path, dockerfile: str) -> None:
    result = run(tools / "hadolint", ROOT / dockerfile)
    assert result.returncode == 0, result.stdout + result.stderr


def test_serving_image_requirements_resolve(tools: Path) -> None:
    """What the serving image pip-installs exists for its Python (3.12, as the vLLM image)."""
    result = run(tools / "python", "-m", "pip", "install", "--dry-run", "--no-deps",
                 "--ignore-installed", "--quiet", "-r",
                 ROOT / "docker" / "serving-requirements.txt")
    assert result.returncode == 0, result.stderr[-2000:]
