"""The planner in the operator: every `autoscaling.intervalSeconds` it scrapes the serving pods,
turns the interval's metrics into a Load, asks the planner (the same code the simulator drives)
for replicas, and remembers the decision for the reconciles in between.

Why in-process rather than a rendered Deployment: the operator already lists the pods, owns
the workloads the decision lands on and writes the status that explains it; a separate
planner would need its own RBAC to patch them and a second writer of the same counts.

Between decisions a task samples prefill and decode every `sample_seconds` (5 s, as the
simulator's driver does): decode's KV, so that the decision sizes decode for the interval's
busy moments, not for the one moment of its scrape; and prefill's queue, which, when it would
make a p90 prompt arriving now miss the TTFT target, scales up at once (`Planner.scale_up`)
and wakes the object's reconcile to apply it.

The decision lives in the operator's memory and in `status.autoscaling` (read back after a
restart); the spec's replica counts stay the user's starting counts, so a GitOps tool that
re-applies the manifest does not fight the planner.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from disagg_operator.association import LABEL_COMPONENT, child_name
from disagg_operator.load import (
    KvSample,
    Scrape,
    kv_sample,
    load_between,
    load_fields,
    prompts_waiting,
)
from disagg_operator.performance import DecodeModel, PrefillModel
from disagg_operator.plan import VLLM_PORT
from disagg_operator.planner import (
    SHORTEST_LOAD_WINDOW_S,
    Bounds,
    Load,
    Planner,
    Replicas,
    Targets,
)
from disagg_operator.spec import AutoscalingSpec, DisaggServingSpec

log = logging.getLogger(__name__)

SCRAPED_ROLES = ("prefill", "decode", "proxy")
SAMPLE_SECONDS = 5.0
Manifest = dict[str, Any]


@dataclass(frozen=True)
class ScrapeTarget:
    pod: str
    role: str
    address: str  # host:port of the pod's /metrics


class MetricsSource(Protocol):
    async def scrape(self, targets: Sequence[ScrapeTarget]) -> Scrape: ...


@dataclass(frozen=True)
class Scaling:
    """What one reconcile does about replicas: the counts the plan uses (None: the spec's, or
    left to an external scaler) and the status section that explains them."""

    replicas: Replicas | None
    status: dict[str, Any]


def with_replicas(spec: DisaggServingSpec, replicas: Replicas | None) -> DisaggServingSpec:
    """The spec with the autoscaler's counts in place of its own (the plan reads the spec)."""
    if replicas is None:
        return spec
    return spec.model_copy(update={
        "prefill": spec.prefill.model_copy(update={"replicas": replicas.prefill}),
        "decode": spec.decode.model_copy(update={"replicas": replicas.decode})})


def scrape_targets(spec: DisaggServingSpec, pods: Sequence[Manifest]) -> list[ScrapeTarget]:
    """Running serving pods with an IP, at the port their metrics are served on."""
    ports = {"prefill": VLLM_PORT, "decode": VLLM_PORT, "proxy": spec.proxy.service.port}
    targets = []
    for pod in pods:
        meta, status = pod.get("metadata") or {}, pod.get("status") or {}
        role = (meta.get("labels") or {}).get(LABEL_COMPONENT)
        if role in ports and status.get("phase") == "Running" and status.get("podIP"):
            targets.append(ScrapeTarget(meta["name"], role, f"{status['podIP']}:{ports[role]}"))
    return targets


def build_planner(autoscaling: AutoscalingSpec) -> Planner:
    profile = autoscaling.profile
    assert profile is not None and autoscaling.ttft_p90_seconds and autoscaling.itl_p90_seconds
    prefill, decode = profile.prefill, profile.decode
    return Planner(
        prefill=PrefillModel(prefill.base_seconds, prefill.per_token_seconds,
                             prefill.per_token_context_seconds, prefill.max_batched_tokens,
                             per_context_token_s=prefill.per_context_token_seconds),
        decode=DecodeModel(decode.base_seconds, decode.per_sequence_seconds,
                           decode.per_context_token_seconds, decode.max_sequences,
                           decode.kv_capacity_tokens),
        targets=Targets(autoscaling.ttft_p90_seconds, autoscaling.itl_p90_seconds),
        bounds=Bounds(autoscaling.prefill.min_replicas, autoscaling.prefill.max_replicas,
                      autoscaling.decode.min_replicas, autoscaling.decode.max_replicas,
                      autoscaling.min_prefill_per_decode, autoscaling.max_prefill_per_decode),
        scale_down_window_s=float(autoscaling.scale_down_stabilization_seconds),
        scale_down_step=autoscaling.scale_down_step)


def starting_replicas(spec: DisaggServingSpec, previous: Mapping[str, Any]) -> Replicas:
    """The planner's last decision as the status recorded it, else the spec's counts; within
    the bounds either way."""
    recorded = previous.get("autoscaling") or {}
    autoscaling = spec.autoscaling

    def start(role: str, spec_count: int) -> int:
        bounds = getattr(autoscaling, role)
        count = (recorded.get(role) or {}).get("desired") \
            if recorded.get("mode") == "Planner" else None
        chosen = int(count) if isinstance(count, int) else spec_count
        return int(min(bounds.max_replicas, max(bounds.min_replicas, chosen)))

    return Replicas(start("prefill", spec.prefill.replicas), start("decode", spec.decode.replicas))


@dataclass
class _PlannerState:
    autoscaling: AutoscalingSpec  # the settings the planner was built from
    planner: Planner
    replicas: Replicas
    next_at: float
    reason: str
    targets: list[ScrapeTarget] = field(default_factory=list)  # as of the last reconcile
    kv_samples: list[KvSample] = field(default_factory=list)  # since the last decision
    last_scrape: Scrape | None = None  # the last decision's
    last_load: Load | None = None  # what the last decision saw
    decided_at: str | None = None
    load: dict[str, float] = field(default_factory=dict)
    # The spec's counts when the planner started from them: a later change (kubectl scale)
    # is not followed, and the status says so.
    spec_replicas: tuple[int, int] = (0, 0)


def _spec_ignored(spec: DisaggServingSpec, state: _PlannerState) -> str | None:
    """What the status says when a role's spec count changed under the planner (kubectl
    scale writes spec.decode.replicas), which it does not follow."""
    changed = [(role, count, getattr(state.replicas, role), getattr(spec.autoscaling, role))
               for role, count, seeded in (
                   ("prefill", spec.prefill.replicas, state.spec_replicas[0]),
                   ("decode", spec.decode.replicas, state.spec_replicas[1]))
               if count != seeded]
    if not changed:
        return None
    return "; ".join(
        f"spec.{role}.replicas is {count}, and in Planner mode the planner sets the count "
        f"(now {now}, within autoscaling.{role}.minReplicas {bounds.min_replicas} and "
        f"maxReplicas {bounds.max_replicas}): to choose it, set those bounds, or set "
        "autoscaling.mode to Off" for role, count, now, bounds in changed)


class Autoscaler:
    def __init__(self, source: MetricsSource, clock: Callable[[], float],
                 wall_clock: Callable[[], str], sample_seconds: float | None = None,
                 wake: Callable[[str], None] | None = None) -> None:
        self.source = source
        self.clock = clock  # monotonic seconds
        self.wall_clock = wall_clock  # RFC 3339, for the status
        # None: no sampling task (a caller, e.g. a test, calls `sample` itself).
        self.sample_seconds = sample_seconds
        # Asks for a reconcile of the object (by uid) to apply a decision made between them.
        self.wake = wake
        self._states: dict[str, _PlannerState] = {}
        self._samplers: dict[str, asyncio.Task[None]] = {}

    def forget(self, uid: str) -> None:
        self._states.pop(uid, None)
        sampler = self._samplers.pop(uid, None)
        if sampler is not None:
            sampler.cancel()

    async def sample(self, uid: str) -> None:
        """Sample decode's KV for the next decision, and scale up now if prefill's queue
        breaks the TTFT target."""
        state = self._states.get(uid)
        if state is None or not state.targets:
            return
        engines = [t for t in state.targets if t.role in ("prefill", "decode")]
        scrape = await self.source.scrape(engines)
        if "decode" in scrape.roles():
            state.kv_samples.append(kv_sample(scrape))
        if "prefill" in scrape.roles() and self._scale_up_now(state, scrape) \
                and self.wake is not None:
            self.wake(uid)

    def _scale_up_now(self, state: _PlannerState, scrape: Scrape) -> bool:
        """A decision between decisions, on the load since the last one, when the queued
        prompts' wait breaks the TTFT target; True if it added instances."""
        earlier, last = state.last_scrape, state.last_load
        if earlier is None or last is None or last.requests_per_s <= 0 \
                or scrape.at - earlier.at < SHORTEST_LOAD_WINDOW_S:
            return False
        queued = prompts_waiting(scrape) * last.uncached_tokens_per_s / last.requests_per_s
        if not state.planner.queue_breaks_ttft(queued, state.replicas.prefill):
            return False
        load = load_between(earlier, scrape, state.kv_samples)
        if load.requests_per_s <= 0:
            return False
        decision = state.planner.scale_up(load, state.replicas)
        if decision.replicas == state.replicas:
            return False
        self._record(state, decision.replicas, decision.reason, load)
        return True

    def _record(self, state: _PlannerState, replicas: Replicas, reason: str,
                load: Load) -> None:
        state.replicas, state.reason = replicas, reason
        state.load = load_fields(load)
        state.decided_at = self.wall_clock()
        log.info("Planner: prefill %d, decode %d (%s)", replicas.prefill, replicas.decode,
                 reason)

    async def _sample_every(self, uid: str, seconds: float) -> None:
        while uid in self._states:
            await asyncio.sleep(seconds)
            with contextlib.suppress(Exception):  # a pod gone mid-scrape: the next sample
                await self.sample(uid)

    def due_in(self, uid: str) -> float | None:
        """Seconds until the next decision for this object, if the planner runs for it."""
        state = self._states.get(uid)
        return None if state is None else max(0.0, state.next_at - self.clock())

    async def scale(self, uid: str, name: str, spec: DisaggServingSpec,
                    pods: Sequence[Manifest], previous: Mapping[str, Any]) -> Scaling | None:
        mode = spec.autoscaling.mode
        if mode != "Planner":
            self.forget(uid)
            if mode == "Off":
                return None
            return Scaling(None, {"mode": "External", "reason": (
                "replicas are left to an external scaler through "
                f"deployments/{child_name(name, 'prefill')}/scale and "
                f"deployments/{child_name(name, 'decode')}/scale")})
        now = self.clock()
        state = self._states.get(uid)
        if state is None or state.autoscaling != spec.autoscaling:
            replicas = starting_replicas(spec, previous)
            planner = build_planner(spec.autoscaling)
            for role, count in (("prefill", replicas.prefill), ("decode", replicas.decode)):
                planner.seed(now, role, count)  # no scale-down before a window of decisions
            state = _PlannerState(spec.autoscaling, planner, replicas, next_at=now,
                                  reason="measuring the first interval",
                                  spec_replicas=(spec.prefill.replicas, spec.decode.replicas))
            self._states[uid] = state
        state.targets = scrape_targets(spec, pods)
        if self.sample_seconds is not None and uid not in self._samplers:
            self._samplers[uid] = asyncio.create_task(
                self._sample_every(uid, self.sample_seconds), name=f"kv-samples-{uid}")
        if now >= state.next_at:
            await self._decide(state, spec, pods, now)
        status = self._status(state)
        if ignored := _spec_ignored(spec, state):
            status["specIgnored"] = ignored
        return Scaling(state.replicas, status)

    async def _decide(self, state: _PlannerState, spec: DisaggServingSpec,
                      pods: Sequence[Manifest], now: float) -> None:
        state.next_at = now + spec.autoscaling.interval_seconds
        scrape = await self.source.scrape(state.targets)
        samples, state.kv_samples = state.kv_samples, []  # of the interval this scrape ends
        missing = [r for r in ("prefill", "decode") if r not in scrape.roles()]
        if missing:
            state.reason = (f"no metrics from any {' or '.join(missing)} instance; keeping "
                            f"prefill {state.replicas.prefill}, decode {state.replicas.decode}")
            return
        earlier, state.last_scrape = state.last_scrape, scrape
        if earlier is None:
            state.reason = (f"measuring the first interval ({spec.autoscaling.interval_seconds}"
                            " s) before deciding")
            return
        load = load_between(earlier, scrape, samples)
        decision = state.planner.decide(now, load, state.replicas)
        state.last_load = load
        self._record(state, decision.replicas, decision.reason, load)

    @staticmethod
    def _status(state: _PlannerState) -> dict[str, Any]:
        status: dict[str, Any] = {
            "mode": "Planner",
            "prefill": {"desired": state.replicas.prefill},
            "decode": {"desired": state.replicas.decode},
            "reason": state.reason}
        if state.decided_at:
            status["lastDecisionTime"] = state.decided_at
        if state.load:
            status["load"] = dict(state.load)
        return status
