"""Status computation from observed children: pure, no cluster."""

from dataclasses import replace
from pathlib import Path

import yaml
from disagg_operator import plan
from disagg_operator.association import Owner, child_name
from disagg_operator.etcd_health import EtcdHealth
from disagg_operator.render import render_spec as render
from disagg_operator.spec import parse_spec
from disagg_operator.status import Observation, compute_status, condition, transition_events

ROOT = Path(__file__).resolve().parents[2]


def _desired() -> list[dict]:
    doc = yaml.safe_load((ROOT / "examples/deepseek-v2-lite-1p2d.yaml").read_text())
    return render(Owner("dsv2-lite", "default", "u"), parse_spec(doc["spec"]), "img")


def _observed(desired: list[dict], ready: dict[str, int]) -> dict:
    observed = {}
    for obj in desired:
        if obj["kind"] in ("Deployment", "StatefulSet"):
            role = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            n = obj["spec"]["replicas"]
            live = {**obj, "metadata": {**obj["metadata"], "generation": 1},
                    "status": {"observedGeneration": 1, "replicas": n, "updatedReplicas": n,
                               "readyReplicas": ready.get(role, n)}}
            observed[(obj["kind"], obj["metadata"]["name"])] = live
    return observed


def _obs(ready: dict[str, int], healthy: bool = True) -> Observation:
    desired = _desired()
    return Observation(generation=1, desired=desired, observed=_observed(desired, ready),
                       etcd_mode="Managed", etcd_endpoints=("e:2379",),
                       etcd_health=EtcdHealth(healthy, "ok" if healthy else "refused"),
                       endpoint="http://dsv2-lite-proxy:8000", roles=_roles())


def _roles() -> dict[str, str]:
    """The plan's role of each workload (the status step takes them from the plan)."""
    doc = yaml.safe_load((ROOT / "examples/deepseek-v2-lite-1p2d.yaml").read_text())
    built = plan.build_plan("dsv2-lite", "default", parse_spec(doc["spec"]),
                            plan.ClusterAddressing("default"))
    return {child_name("dsv2-lite", c.role): c.role for c in built.components}


def test_all_ready_is_ready_and_transition_time_is_kept() -> None:
    first = compute_status(_obs({}), {}, "t1")
    assert condition(first, "Ready")["status"] == "True"
    assert first["decode"] == {"replicas": 2, "readyReplicas": 2, "summary": "2/2",
                               "selector": "app.kubernetes.io/component=decode,"
                                           "app.kubernetes.io/instance=dsv2-lite"}
    again = compute_status(_obs({}), first, "t2")
    assert again == first  # nothing changed: no write needed, times kept
    assert [e.reason for e in transition_events({}, first)] == ["Ready"]


def test_a_role_below_its_replicas_serves_degraded_and_one_with_none_is_not_ready() -> None:
    status = compute_status(_obs({"decode": 1}), {}, "t1")
    ready, degraded = condition(status, "Ready"), condition(status, "Degraded")
    assert (ready["status"], ready["reason"]) == ("True", "Serving")
    assert (degraded["status"], degraded["reason"]) == ("True", "ReducedCapacity")
    assert "decode: 1 of 2 ready" in degraded["message"]
    status = compute_status(_obs({"decode": 0}), status, "t2")
    ready = condition(status, "Ready")
    assert (ready["status"], ready["reason"]) == ("False", "ComponentsNotReady")
    assert "decode: 0 of 2 ready" in ready["message"]


def test_ready_stays_true_while_old_pods_serve_a_rollout() -> None:
    obs = _obs({})
    first = compute_status(obs, {}, "t1")
    for key, live in obs.observed.items():
        if key[1] == "dsv2-lite-prefill":  # the new pods are not ready; the old one serves
            live["metadata"]["generation"] = 2
            live["status"] = {"observedGeneration": 2, "replicas": 2, "updatedReplicas": 1,
                              "readyReplicas": 1}
    status = compute_status(obs, first, "t2")
    assert condition(status, "Ready")["status"] == "True"
    assert condition(status, "Progressing")["reason"] == "RollingOut"
    assert "prefill: 1 of 1 updated" in condition(status, "Progressing")["message"]
    assert condition(status, "Degraded")["status"] == "False"
    assert transition_events(first, status) == []  # no Warning while it serves


def test_unhealthy_etcd_blocks_ready_and_degrades() -> None:
    status = compute_status(_obs({}, healthy=False), {}, "t1")
    assert condition(status, "Ready")["reason"] == "EtcdUnhealthy"
    assert condition(status, "Degraded")["status"] == "True"
    assert "refused" in condition(status, "Ready")["message"]


def test_an_instance_that_keeps_failing_at_start_is_named_with_its_message() -> None:
    obs = _obs({"prefill": 0})
    crashing = {"metadata": {"name": "dsv2-lite-prefill-abc"}, "status": {"containerStatuses": [
        {"name": "vllm", "restartCount": 3,
         "state": {"waiting": {"reason": "CrashLoopBackOff"}},
         "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message":
             "INFO loading\nkvhelper.tp.TPMismatchError: store_tp_size 6 does not divide the "
             "model's 8 KV heads; use a divisor of 8\n"}}},
        {"name": "registrar", "restartCount": 0, "state": {"running": {}}}]}}
    healthy = {"metadata": {"name": "dsv2-lite-decode-x"}, "status": {"containerStatuses": [
        {"name": "vllm", "restartCount": 0, "state": {"running": {}}}]}}
    obs = Observation(**{**obs.__dict__, "pods": [crashing, healthy]})
    degraded = condition(compute_status(obs, {}, "t1"), "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "InstancesFailing")
    assert "pod dsv2-lite-prefill-abc container vllm exited with code 1" in degraded["message"]
    assert "store_tp_size 6 does not divide the model's 8 KV heads" in degraded["message"]


def test_the_planners_decision_is_shown_with_the_instances_now_and_announced() -> None:
    decided = {"mode": "Planner", "prefill": {"desired": 1}, "decode": {"desired": 2},
               "reason": "measuring"}
    first = compute_status(replace(_obs({"decode": 1}), autoscaling=decided), {}, "t1")
    assert first["autoscaling"]["decode"] == {"desired": 2, "current": 1}
    grown = {**decided, "decode": {"desired": 3}, "reason": "40 concurrent sequences"}
    obs = _obs({})
    second = compute_status(replace(obs, autoscaling=grown), first, "t2")
    events = transition_events(first, second)
    assert [(e.reason, e.message) for e in events if e.reason == "Autoscaled"] == [
        ("Autoscaled", "planner: decode 2 -> 3: 40 concurrent sequences")]


def test_an_externally_scaled_role_reports_the_count_its_scaler_set() -> None:
    obs = _obs({})
    desired = [{**d, "spec": {k: v for k, v in d["spec"].items() if k != "replicas"}}
               if d["metadata"]["name"] == "dsv2-lite-decode" else d for d in obs.desired]
    live = dict(obs.observed)
    key = ("Deployment", "dsv2-lite-decode")
    live[key] = {**live[key], "spec": {**live[key]["spec"], "replicas": 5},
                 "status": {**live[key]["status"], "replicas": 5, "updatedReplicas": 5,
                            "readyReplicas": 4}}
    status = compute_status(replace(obs, desired=desired, observed=live,
                                    autoscaling={"mode": "External"}), {}, "t1")
    assert status["decode"]["replicas"] == 5
    assert status["autoscaling"]["decode"] == {"desired": 5, "current": 4}


def test_the_status_says_secret_missing_instead_of_components_not_ready() -> None:
    message = "Secret x (named by spec.etcd.tls.clientSecret) does not exist in namespace d"
    before = compute_status(_obs({"prefill": 0}), {}, "t1")
    assert condition(before, "Ready")["reason"] == "ComponentsNotReady"
    status = compute_status(replace(_obs({"prefill": 0}), missing_secrets=(message,)),
                            before, "t2")
    for ctype, expected in (("Ready", "False"), ("Progressing", "False"), ("Degraded", "True")):
        found = condition(status, ctype)
        assert (found["status"], found["reason"]) == (expected, "SecretMissing"), ctype
        assert message in found["message"]
    # One Warning (Ready's reason changed), not a second one for Degraded saying the same.
    assert [(e.type, e.reason) for e in transition_events(before, status)] == [
        ("Warning", "SecretMissing")]


def test_a_spec_warning_is_a_condition_and_one_event() -> None:
    from disagg_operator.spec import SpecWarning

    quiet = compute_status(_obs({}), {}, "t1")
    assert (condition(quiet, "ConfigWarning")["status"],
            condition(quiet, "ConfigWarning")["reason"]) == ("False", "NoWarnings")
    warned = replace(_obs({}), warnings=(SpecWarning("KVHeadsUnset", "model.kvHeads ..."),))
    status = compute_status(warned, quiet, "t2")
    found = condition(status, "ConfigWarning")
    assert (found["status"], found["reason"]) == ("True", "KVHeadsUnset")
    assert condition(status, "Ready")["status"] == "True"  # a warning does not stop serving
    assert [(e.type, e.reason) for e in transition_events(quiet, status)] == [
        ("Warning", "KVHeadsUnset")]
    assert transition_events(status, compute_status(warned, status, "t3")) == []
