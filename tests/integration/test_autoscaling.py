"""The operator running the planner against the API emulator: it scrapes the pods' metrics
(stand-in pages on loopback, since the emulator's pods run nothing), decides, patches only
the role it scales, and says so in the status and an Event. And an external scaler's writes
through a Deployment's /scale stay when autoscaling.mode is External."""

from __future__ import annotations

import copy
import time
from typing import Any

import pytest
from disagg_devtools.emulator.metric_pages import EnginePage, MetricPagesServer, ProxyPage
from disagg_devtools.emulator.sandbox import Sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_operator import autoscaler as autoscaler_module
from disagg_operator.handlers import OperatorConfig
from disagg_operator.spec import PLURAL

from .conftest import NAMESPACE, Api, example, fast_config
from .stand_in_pods import add_pods, metric_overrides

PROFILE = {
    "prefill": {"baseSeconds": 0.05, "perTokenSeconds": 1e-4},
    "decode": {"baseSeconds": 0.01, "perSequenceSeconds": 1e-4,
               "perContextTokenSeconds": 1e-6, "kvCapacityTokens": 10000},
}


@pytest.fixture
def config(etcd: EtcdProcess, pages: MetricPagesServer) -> OperatorConfig:
    return fast_config(etcd, metrics_address_overrides=metric_overrides(pages),
                       planner_sample_seconds=0.5)


async def create_planned(cluster: Sandbox, api: Api) -> None:
    """The seed DisaggServing in Planner mode, with its serving pods running."""
    body = copy.deepcopy(example("deepseek-v2-lite-1p2d.yaml"))
    body["spec"]["autoscaling"] = {
        "mode": "Planner", "ttftP90Seconds": 2.0, "itlP90Seconds": 0.05,
        "intervalSeconds": 10, "profile": PROFILE, "decode": {"maxReplicas": 8}}
    add_pods(cluster)
    await api.create(body)


def autoscaling(api: Api) -> dict[str, Any]:
    return ((api.dsv("dsv2-lite") or {}).get("status") or {}).get("autoscaling") or {}


async def test_the_planner_scales_decode_on_kv_demand_and_patches_only_decode(
        cluster: Sandbox, api: Api, pages: MetricPagesServer) -> None:
    await create_planned(cluster, api)
    await api.wait(lambda: "before deciding" in autoscaling(api).get("reason", ""),
                   "the first scrape")
    await api.wait(lambda: autoscaling(api).get("decode") == {"desired": 2, "current": 2},
                   "the spec's 2 decode instances, ready")
    mark = api.mark()
    for name in ("dsv2-lite-decode-a", "dsv2-lite-decode-b"):
        page = pages.pages[name]
        assert isinstance(page, EnginePage)
        page.kv_usage.set(0.9)  # 14,400 of 16,000 tokens each: 28,800 wanted
        for _ in range(10):
            page.served(prompt=100, computed=0, output=20, itl_s=0.02)
    prefill, proxy = pages.pages["dsv2-lite-prefill-a"], pages.pages["dsv2-lite-proxy-a"]
    assert isinstance(prefill, EnginePage) and isinstance(proxy, ProxyPage)
    for _ in range(20):
        proxy.arrived.inc()
        prefill.served(prompt=100, computed=100, output=1, itl_s=0.0)

    # 28,800 KV tokens over 7,000 per instance (10,000 kept 70% full): 5 decode instances.
    await api.wait(lambda: (api.get("deployments", "dsv2-lite-decode") or {})
                   .get("spec", {}).get("replicas") == 5, "decode scaled to 5", timeout=30)
    await api.wait(lambda: autoscaling(api).get("decode", {}).get("current") == 5,
                   "the status to show 5 decode instances")
    status = autoscaling(api)
    assert status["mode"] == "Planner"
    assert status["prefill"] == {"desired": 1, "current": 1}
    assert "KV tokens wanted" in status["reason"]
    assert status["load"]["requestsPerSecond"] > 0 and "lastDecisionTime" in status
    assert [w for w in api.writes_since(mark) if PLURAL not in w] == [
        "PATCH /apis/apps/v1/namespaces/default/deployments/dsv2-lite-decode"]
    assert api.dsv("dsv2-lite")["spec"]["decode"]["replicas"] == 2  # type: ignore[index]
    await api.wait(lambda: any("planner: decode 2 -> 5" in e.get("message", "")
                               for e in api.events("Autoscaled")), "an Autoscaled event")


async def test_a_prefill_queue_past_the_ttft_target_scales_prefill_before_the_interval(
        cluster: Sandbox, api: Api, pages: MetricPagesServer,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Between two decisions the operator samples the engines; a prefill queue that alone
    breaks the TTFT target scales prefill up at once, and the reconcile it wakes applies it,
    long before the next interval."""
    monkeypatch.setattr(autoscaler_module, "SHORTEST_LOAD_WINDOW_S", 1.0)  # the test's pace
    body = copy.deepcopy(example("deepseek-v2-lite-1p2d.yaml"))
    body["spec"]["autoscaling"] = {
        "mode": "Planner", "ttftP90Seconds": 2.0, "itlP90Seconds": 0.05,
        "intervalSeconds": 10, "profile": PROFILE, "prefill": {"maxReplicas": 8}}
    add_pods(cluster)
    prefill = pages.pages["dsv2-lite-prefill-a"]
    assert isinstance(prefill, EnginePage)
    await api.create(body)
    await api.wait(lambda: "before deciding" in autoscaling(api).get("reason", ""),
                   "the first scrape")
    decode = pages.pages["dsv2-lite-decode-a"]
    assert isinstance(decode, EnginePage)

    proxy = pages.pages["dsv2-lite-proxy-a"]
    assert isinstance(proxy, ProxyPage)

    def serve(prompts: int) -> None:
        for _ in range(prompts):
            proxy.arrived.inc()
            prefill.served(prompt=1000, computed=1000, output=1, itl_s=0.0)
            decode.served(prompt=1000, computed=0, output=4, itl_s=0.02)

    serve(20)  # 20 prompts of 1,000 tokens in the first interval
    await api.wait(lambda: "uncached tokens/s" in autoscaling(api).get("reason", ""),
                   "the first decision", timeout=20)
    decided = time.monotonic()
    assert autoscaling(api)["prefill"]["desired"] == 1
    # About 9,000 prompt tokens a second per instance (0.05 s + 1e-4 s a token for 8,192-
    # token steps): 40 queued prompts of 1,000 tokens wait about 4.4 s, over the 2 s target.
    serve(100)
    prefill.waiting.set(40)
    await api.wait(lambda: ((api.get("deployments", "dsv2-lite-prefill") or {})
                            .get("spec", {}).get("replicas") or 1) > 1,
                   "prefill scaled up", timeout=20)
    assert time.monotonic() - decided < 10  # before the next decision
    await api.wait(lambda: "queue breaks the TTFT target" in autoscaling(api)["reason"],
                   "the status to say why")


async def test_an_external_scalers_count_stays(cluster: Sandbox, api: Api) -> None:
    body = copy.deepcopy(example("deepseek-v2-lite-1p2d.yaml"))
    body["spec"]["autoscaling"] = {"mode": "External"}
    await api.create(body)
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady")
    await api._request(  # what an HPA does
        "PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/dsv2-lite-decode/scale",
        {"spec": {"replicas": 4}}, content_type="application/merge-patch+json")
    await api.wait(lambda: autoscaling(api).get("decode") == {"desired": 4, "current": 4},
                   "the status to show the scaler's 4")
    mark = api.mark()
    await api.patch_spec("dsv2-lite", {"prefill": {"gpuMemoryUtilization": 0.85}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=2)
    assert (api.get("deployments", "dsv2-lite-decode") or {})["spec"]["replicas"] == 4
    assert "deployments/dsv2-lite-decode/scale" in autoscaling(api)["reason"]
    assert "PATCH /apis/apps/v1/namespaces/default/deployments/dsv2-lite-prefill" in \
        api.writes_since(mark)


async def test_switching_to_external_scaling_keeps_the_replica_counts(cluster: Sandbox,
                                                                      api: Api) -> None:
    """3 prefill and 2 decode, then `autoscaling.mode: External`: the operator stops applying
    `replicas`, and server-side apply removes a field that its only manager stops applying, so
    the Deployments fell to 1 and 1 (a real API server does the same). The operator hands the
    field over to a manager of its own before it lets go."""
    body = copy.deepcopy(example("deepseek-v2-lite-1p2d.yaml"))
    body["spec"].setdefault("prefill", {})["replicas"] = 3
    body["spec"].setdefault("decode", {})["replicas"] = 2
    await api.create(body)
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady")
    await api.patch_spec("dsv2-lite", {"autoscaling": {"mode": "External"}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=2)
    await api.wait(lambda: autoscaling(api).get("mode") == "External",
                   "the status to say External")
    replicas = {role: (api.get("deployments", f"dsv2-lite-{role}") or {})["spec"].get("replicas")
                for role in ("prefill", "decode")}
    assert replicas == {"prefill": 3, "decode": 2}, replicas
    # The scaler's writes stay, and the operator's later applies leave them.
    await api._request(
        "PATCH", f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/dsv2-lite-decode/scale",
        {"spec": {"replicas": 5}}, content_type="application/merge-patch+json")
    await api.patch_spec("dsv2-lite", {"prefill": {"gpuMemoryUtilization": 0.85}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=3)
    assert (api.get("deployments", "dsv2-lite-decode") or {})["spec"]["replicas"] == 5
    assert (api.get("deployments", "dsv2-lite-prefill") or {})["spec"]["replicas"] == 3
    # Back to the spec's counts when the operator scales again.
    await api.patch_spec("dsv2-lite", {"autoscaling": {"mode": "Off"}})
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady",
                             generation=4)
    await api.wait(lambda: (api.get("deployments", "dsv2-lite-decode") or {})["spec"].get(
        "replicas") == 2, "decode back to the spec's 2")


async def test_kubectl_scale_in_planner_mode_is_explained(cluster: Sandbox, api: Api,
                                                          pages: MetricPagesServer) -> None:
    """`kubectl scale dsv --replicas 5` in Planner mode printed "scaled" and did nothing. The
    planner still decides the count; the status says the spec's count is not followed and what
    to do instead, and a Warning Event says it once."""
    await create_planned(cluster, api)
    await api.wait(lambda: autoscaling(api).get("decode") == {"desired": 2, "current": 2},
                   "the spec's 2 decode instances, ready")
    assert "specIgnored" not in autoscaling(api)
    await api._request(  # what `kubectl scale disaggserving dsv2-lite --replicas 5` sends
        "PATCH", f"/apis/serving.disagg.dev/v1alpha1/namespaces/{NAMESPACE}/{PLURAL}/"
        "dsv2-lite/scale", {"spec": {"replicas": 5}},
        content_type="application/merge-patch+json")
    await api.wait(lambda: "specIgnored" in autoscaling(api), "the status to explain")
    note = autoscaling(api)["specIgnored"]
    assert "spec.decode.replicas is 5" in note and "maxReplicas" in note and "Off" in note
    assert (api.get("deployments", "dsv2-lite-decode") or {})["spec"]["replicas"] == 2
    await api.wait(lambda: [e for e in api.events("ScaleIgnored") if e["type"] == "Warning"],
                   "a Warning Event")
    await api._request(
        "PATCH", f"/apis/serving.disagg.dev/v1alpha1/namespaces/{NAMESPACE}/{PLURAL}/"
        "dsv2-lite/scale", {"spec": {"replicas": 2}},
        content_type="application/merge-patch+json")
    await api.wait(lambda: "specIgnored" not in autoscaling(api), "the note to go")
