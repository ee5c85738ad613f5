"""The operator's autoscaler: scrapes at its interval, decides with the planner, remembers the
decision between reconciles and across a restart (through the status)."""

from collections.abc import Sequence
from typing import Any

import pytest
from disagg_devtools.emulator.metric_pages import EnginePage, ProxyPage
from disagg_operator.autoscaler import (
    Autoscaler,
    ScrapeTarget,
    scrape_targets,
    with_replicas,
)
from disagg_operator.load import Scrape
from disagg_operator.metrics_scrape import parse_pod_metrics
from disagg_operator.planner import Replicas
from disagg_operator.spec import DisaggServingSpec, parse_spec

PROFILE = {
    "prefill": {"baseSeconds": 0.02, "perTokenSeconds": 1e-4, "maxBatchedTokens": 2048},
    "decode": {"baseSeconds": 0.01, "perSequenceSeconds": 1e-4,
               "perContextTokenSeconds": 1e-6, "maxSequences": 128,
               "kvCapacityTokens": 100000},
}


def planner_spec(**autoscaling: Any) -> DisaggServingSpec:
    return parse_spec({
        "model": {"name": "tiny"}, "prefill": {"replicas": 1}, "decode": {"replicas": 2},
        "autoscaling": {"mode": "Planner", "ttftP90Seconds": 1.0, "itlP90Seconds": 0.05,
                        "intervalSeconds": 60, "profile": PROFILE,
                        "prefill": {"maxReplicas": 6}, "decode": {"maxReplicas": 6},
                        **autoscaling}})


class PagesSource:
    """Test double for the pods' /metrics: parses the stand-in pages of every target."""

    def __init__(self, clock: "Clock") -> None:
        self.clock = clock
        self.pages = {"p-0": EnginePage(), "d-0": EnginePage(), "x-0": ProxyPage()}
        self.scraped: list[list[str]] = []

    async def scrape(self, targets: Sequence[ScrapeTarget]) -> Scrape:
        self.scraped.append([t.pod for t in targets])
        return Scrape(self.clock.now, {t.pod: parse_pod_metrics(
            t.role, self.pages[t.pod].page().decode()) for t in targets})

    def traffic(self, requests: int, prompt: int) -> None:
        prefill, decode, proxy = self.pages["p-0"], self.pages["d-0"], self.pages["x-0"]
        assert isinstance(prefill, EnginePage) and isinstance(decode, EnginePage)
        assert isinstance(proxy, ProxyPage)
        for _ in range(requests):
            proxy.arrived.inc()
            prefill.served(prompt, prompt, 1, 0.0)
            decode.served(prompt, 0, 20, 0.02)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _pod(name: str, role: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"app.kubernetes.io/component": role}},
            "status": {"phase": "Running", "podIP": "10.0.0.1"}}


PODS = [_pod("p-0", "prefill"), _pod("d-0", "decode"), _pod("x-0", "proxy")]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def source(clock: Clock) -> PagesSource:
    return PagesSource(clock)


@pytest.fixture
def autoscaler(clock: Clock, source: PagesSource) -> Autoscaler:
    return Autoscaler(source, clock, lambda: "2026-12-05T00:00:00Z")


async def test_the_first_interval_is_measured_then_prefill_grows_with_its_load(
        autoscaler: Autoscaler, source: PagesSource, clock: Clock) -> None:
    spec = planner_spec()
    first = await autoscaler.scale("u", "d", spec, PODS, {})
    assert first is not None and first.replicas == Replicas(1, 2)
    assert "measuring the first interval" in first.status["reason"]
    assert autoscaler.due_in("u") == 60
    clock.now += 30
    source.traffic(10, 1000)
    assert (await autoscaler.scale("u", "d", spec, PODS, {})).replicas == Replicas(1, 2)
    assert len(source.scraped) == 1  # between decisions: no scrape
    clock.now += 30
    source.traffic(3000, 1000)  # 3,000 prompts of 1,000 tokens a minute: ~5.3 instances' work
    decided = await autoscaler.scale("u", "d", spec, PODS, {})
    assert decided is not None and decided.replicas.prefill == 6
    assert decided.status["prefill"] == {"desired": 6}
    assert "uncached tokens/s" in decided.status["reason"]
    assert decided.status["load"]["requestsPerSecond"] == pytest.approx(3010 / 60, rel=1e-3)
    assert decided.status["lastDecisionTime"] == "2026-12-05T00:00:00Z"


async def test_a_restarted_operator_starts_from_the_recorded_decision_within_bounds(
        autoscaler: Autoscaler) -> None:
    recorded = {"autoscaling": {"mode": "Planner", "prefill": {"desired": 4},
                                "decode": {"desired": 9}}}
    scaling = await autoscaler.scale("u", "d", planner_spec(), PODS, recorded)
    assert scaling is not None and scaling.replicas == Replicas(4, 6)  # decode max is 6


async def test_no_metrics_keeps_the_counts_and_says_why(autoscaler: Autoscaler) -> None:
    scaling = await autoscaler.scale("u", "d", planner_spec(), PODS[2:], {})
    assert scaling is not None and scaling.replicas == Replicas(1, 2)
    assert "no metrics from any prefill or decode instance" in scaling.status["reason"]


async def test_scale_down_waits_for_the_stabilisation_window(
        autoscaler: Autoscaler, source: PagesSource, clock: Clock) -> None:
    spec = planner_spec(scaleDownStabilizationSeconds=120)
    recorded = {"autoscaling": {"mode": "Planner", "prefill": {"desired": 3},
                                "decode": {"desired": 3}}}
    await autoscaler.scale("u", "d", spec, PODS, recorded)
    counts = []
    for _ in range(4):  # idle: the planner wants the minimum
        clock.now += 60
        scaling = await autoscaler.scale("u", "d", spec, PODS, recorded)
        assert scaling is not None and scaling.replicas is not None
        counts.append(scaling.replicas.prefill)
    assert counts == [3, 3, 2, 1]  # 120 s of agreement, then one instance a decision


async def test_off_and_external_modes(autoscaler: Autoscaler) -> None:
    off = parse_spec({"model": {"name": "tiny"}})
    assert await autoscaler.scale("u", "d", off, PODS, {}) is None
    external = parse_spec({"model": {"name": "tiny"}, "autoscaling": {"mode": "External"}})
    scaling = await autoscaler.scale("u", "d", external, PODS, {})
    assert scaling is not None and scaling.replicas is None
    assert "deployments/d-decode/scale" in scaling.status["reason"]
    assert autoscaler.due_in("u") is None


def test_targets_are_running_serving_pods_at_their_metrics_port() -> None:
    spec = parse_spec({"model": {"name": "tiny"}, "proxy": {"service": {"port": 9000}}})
    pending = {**_pod("d-1", "decode"), "status": {"phase": "Pending"}}
    master = _pod("m-0", "mooncake-master")
    assert scrape_targets(spec, [*PODS, pending, master]) == [
        ScrapeTarget("p-0", "prefill", "10.0.0.1:8000"),
        ScrapeTarget("d-0", "decode", "10.0.0.1:8000"),
        ScrapeTarget("x-0", "proxy", "10.0.0.1:9000")]


def test_with_replicas_replaces_only_the_counts() -> None:
    spec = planner_spec()
    scaled = with_replicas(spec, Replicas(3, 5))
    assert (scaled.prefill.replicas, scaled.decode.replicas) == (3, 5)
    assert scaled.model_copy(update={"prefill": spec.prefill, "decode": spec.decode}) == spec
    assert with_replicas(spec, None) is spec


@pytest.mark.parametrize(("autoscaling", "message"), [
    ({"mode": "Planner"}, "mode Planner needs ttftP90Seconds, itlP90Seconds, profile"),
    ({"prefill": {"minReplicas": 4, "maxReplicas": 2}}, "autoscaling.prefill: minReplicas"),
    ({"minPrefillPerDecode": 2, "maxPrefillPerDecode": 1}, "minPrefillPerDecode must not"),
])
def test_bad_autoscaling_settings_name_the_field(autoscaling: dict[str, Any],
                                                 message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_spec({"model": {"name": "tiny"}, "autoscaling": autoscaling})


async def test_decode_is_sized_for_the_kv_sampled_between_decisions(
        autoscaler: Autoscaler, source: PagesSource, clock: Clock) -> None:
    """A burst of KV between two scrapes is seen by the samples taken every few seconds (the
    simulator's driver samples every 5 s), not only by the scrape that ends the interval."""
    spec = planner_spec()
    decode = EnginePage(num_gpu_blocks=50_000, block_size=16)  # 800,000 tokens
    source.pages["d-0"] = decode
    await autoscaler.scale("u", "d", spec, PODS, {})  # the first interval starts
    source.scraped.clear()
    for usage in [1.0] * 10 + [0.0] * 2:  # 80% of 800,000 tokens is 6.4 instances' KV
        clock.now += 5
        decode.kv_usage.set(usage)
        await autoscaler.sample("u")
    assert source.scraped == [["p-0", "d-0"]] * 12  # samples ask the engines only
    source.traffic(10, 100)
    decided = await autoscaler.scale("u", "d", spec, PODS, {})
    assert decided is not None and decided.replicas is not None
    assert decided.replicas.decode == 6 and decided.status["load"]["kvTokensDemand"] == 800_000
    # The samples served that decision: the next interval starts from none.
    clock.now += 60
    source.traffic(10, 100)
    later = await autoscaler.scale("u", "d", spec, PODS, {})
    assert later is not None and later.status["load"]["kvTokensDemand"] == 0


async def test_the_sampling_task_runs_between_reconciles_and_stops_with_the_object(
        clock: Clock, source: PagesSource) -> None:
    import asyncio

    autoscaler = Autoscaler(source, clock, lambda: "2026-12-05T00:00:00Z", sample_seconds=0.01)
    await autoscaler.scale("u", "d", planner_spec(), PODS, {})

    async def sampled(count: int) -> None:
        while source.scraped.count(["p-0", "d-0"]) < count:
            await asyncio.sleep(0.01)

    await asyncio.wait_for(sampled(3), 10)
    autoscaler.forget("u")
    await asyncio.sleep(0)  # the cancelled task ends
    taken = len(source.scraped)
    await asyncio.sleep(0.05)
    assert len(source.scraped) == taken


async def test_a_prefill_queue_that_breaks_the_ttft_target_scales_up_between_decisions(
        source: PagesSource, clock: Clock) -> None:
    """A sample that finds prefill's queue past what the TTFT target allows scales up at once,
    on the load since the last decision, and wakes the object's reconcile to apply it; a
    shorter queue, or one seen too soon after a decision to measure a load, waits for the
    interval."""
    woken: list[str] = []
    autoscaler = Autoscaler(source, clock, lambda: "2026-12-05T00:00:00Z", wake=woken.append)
    spec = planner_spec()
    prefill = source.pages["p-0"]
    assert isinstance(prefill, EnginePage)
    await autoscaler.scale("u", "d", spec, PODS, {})
    clock.now += 60
    source.traffic(10, 1000)
    first = await autoscaler.scale("u", "d", spec, PODS, {})
    assert first is not None and first.replicas == Replicas(1, 2)
    # About 9,100 prompt tokens a second per instance for 1,000-token prompts: the target
    # (1 s) allows about 9 of them queued.
    prefill.waiting.set(50)
    clock.now += 10
    await autoscaler.sample("u")
    assert woken == []  # 10 s is too short a load to scale on
    clock.now += 20
    source.traffic(600, 1000)
    prefill.waiting.set(5)
    await autoscaler.sample("u")
    assert woken == []  # 5 queued prompts wait about 0.5 s
    prefill.waiting.set(50)
    await autoscaler.sample("u")
    assert woken == ["u"]
    assert autoscaler.due_in("u") == 30  # the interval's decision stays where it was
    scaled = await autoscaler.scale("u", "d", spec, PODS, {})
    assert scaled is not None and scaled.replicas is not None
    assert scaled.replicas.prefill > 1 and scaled.replicas.decode >= 2
    assert "queue breaks the TTFT target" in scaled.status["reason"]
