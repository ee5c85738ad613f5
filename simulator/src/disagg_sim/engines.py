"""Prefill and decode instances as the simulator models them.

Prefill: one FCFS queue, chunked prefill (each step takes up to `max_batched_tokens` of the
queue's head), the step time from the profile. Decode: continuous batching; a sequence joins
at a step boundary when a slot and KV space are free, and each step gives every running
sequence one token. Between events a decode batch is advanced in closed form: with B running
sequences and C context tokens, k steps take `a*k + b*k*(k-1)/2` seconds (a = the step time
now, b = the growth of the step time as every context grows by one token per step).

Instances that share one machine's cores (vLLM's CPU build, every engine on the same few
cores; `Profile.shared_cores`) run each step `slowdown()` times slower: the number of
instances busy at once, each of which would use all the cores alone (processor sharing). A
prefill step takes the factor when it starts, a decode batch at each of its events.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from disagg_operator.performance import DecodeModel, PrefillModel

from disagg_sim.events import EventLoop
from disagg_sim.trace import Request

EPSILON = 1e-12


@dataclass(eq=False)
class PrefillJob:
    request: Request
    cached_tokens: int
    on_done: Callable[[float], None]
    done_tokens: int = 0
    load_seconds: float = 0.0  # store reads in the step that first computes it
    expected: bool = False  # counted in the instance's incoming work until submitted

    @property
    def computed_tokens(self) -> int:
        return self.request.prompt_tokens - self.cached_tokens


def alone() -> float:
    return 1.0


class PrefillInstance:
    def __init__(self, name: str, model: PrefillModel, loop: EventLoop,
                 slowdown: Callable[[], float] = alone) -> None:
        self.name, self.model, self.loop = name, model, loop
        self.slowdown = slowdown
        self.queue: deque[PrefillJob] = deque()
        self.queued_tokens = 0  # tokens still to compute, the step in progress included
        self.incoming_tokens = 0  # routed here, still loading cached blocks before the queue
        self.busy = False
        self.draining = False
        self.busy_seconds = 0.0

    @property
    def idle(self) -> bool:
        return not self.busy and not self.queue and not self.incoming_tokens

    @property
    def expected_tokens(self) -> int:
        """Work routed here and not done yet: what load-aware routing compares."""
        return self.queued_tokens + self.incoming_tokens

    def expect(self, job: PrefillJob) -> None:
        """Count `job` as routed here before it is submitted (it loads cached blocks first)."""
        self.incoming_tokens += job.computed_tokens
        job.expected = True

    def submit(self, job: PrefillJob) -> None:
        if job.expected:
            self.incoming_tokens -= job.computed_tokens
            job.expected = False
        self.queue.append(job)
        self.queued_tokens += job.computed_tokens
        if not self.busy:
            self._start_step()

    def _start_step(self) -> None:
        budget = self.model.max_batched_tokens
        chunks: list[tuple[PrefillJob, int]] = []
        tokens, token_context, context, loads = 0, 0.0, 0.0, 0.0
        for job in self.queue:
            if not job.done_tokens:
                loads += job.load_seconds
            take = min(budget, job.computed_tokens - job.done_tokens)
            token_context += take * (job.cached_tokens + job.done_tokens + take / 2)
            context += job.cached_tokens + job.done_tokens
            chunks.append((job, take))
            tokens += take
            budget -= take
            if budget <= 0:
                break
        self.busy = True
        duration = (self.model.step_seconds(tokens, token_context, context)
                    + loads) * self.slowdown()
        self.busy_seconds += duration
        self.loop.at(self.loop.now + duration, lambda: self._finish_step(chunks))

    def _finish_step(self, chunks: list[tuple[PrefillJob, int]]) -> None:
        for job, take in chunks:
            job.done_tokens += take
            self.queued_tokens -= take
            if job.done_tokens >= job.computed_tokens:
                self.queue.remove(job)
                job.on_done(self.loop.now)
        self.busy = False
        if self.queue:
            self._start_step()


@dataclass(eq=False)
class Sequence:
    request: Request
    on_first_token: Callable[[float], None]
    on_finish: Callable[[float], None]
    join_step: int = 0

    @property
    def reserved_tokens(self) -> int:
        return self.request.prompt_tokens + self.request.output_tokens


@dataclass
class DecodeInstance:
    name: str
    model: DecodeModel
    loop: EventLoop
    draining: bool = False
    time: float = 0.0  # the state below is at this step boundary
    steps: int = 0
    context_tokens: float = 0.0
    reserved_tokens: int = 0
    running: dict[int, Sequence] = field(default_factory=dict)
    waiting: deque[Sequence] = field(default_factory=deque)
    busy_seconds: float = 0.0
    slowdown: Callable[[], float] = alone
    _factor: float = 1.0  # slowdown() at the last event
    _finishing: list[tuple[int, int]] = field(default_factory=list)  # (finish step, id)
    _awaiting_first: list[Sequence] = field(default_factory=list)
    _version: int = 0

    @property
    def outstanding(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def idle(self) -> bool:
        return not self.running and not self.waiting

    def arrive(self, sequence: Sequence) -> None:
        self._sync(self.loop.now)
        self.waiting.append(sequence)
        self._admit()
        self._factor = self.slowdown()
        self._schedule()

    # -- the batch in closed form ----------------------------------------------------------

    def _coefficients(self) -> tuple[float, float]:
        m = self.model
        batch, f = len(self.running), self._factor
        return (f * (m.base_s + m.per_sequence_s * batch + m.per_context_token_s
                     * self.context_tokens), f * m.per_context_token_s * batch)

    def _duration(self, steps: int) -> float:
        a, b = self._coefficients()
        return a * steps + b * steps * (steps - 1) / 2

    def _steps_to_reach(self, elapsed: float) -> int:
        """The fewest steps whose duration is at least `elapsed` (the next boundary)."""
        if elapsed <= EPSILON:
            return 0
        a, b = self._coefficients()
        if b <= 0:
            k = math.ceil(elapsed / a - 1e-9)
        else:
            half = a - b / 2
            k = math.ceil((-half + math.sqrt(half * half + 2 * b * elapsed)) / b - 1e-9)
        while k > 1 and self._duration(k - 1) >= elapsed - EPSILON:
            k -= 1
        while self._duration(k) < elapsed - EPSILON:
            k += 1
        return k

    def _advance(self, steps: int) -> None:
        duration = self._duration(steps)
        if self._awaiting_first:
            first = self.time + self._duration(1)
            for sequence in self._awaiting_first:
                sequence.on_first_token(first)
            self._awaiting_first.clear()
        self.busy_seconds += duration
        self.time += duration
        self.context_tokens += len(self.running) * steps
        self.steps += steps
        while self._finishing and self._finishing[0][0] <= self.steps:
            _, ident = heapq.heappop(self._finishing)
            sequence = self.running.pop(ident)
            self.context_tokens -= sequence.request.prompt_tokens + (self.steps
                                                                     - sequence.join_step)
            self.reserved_tokens -= sequence.reserved_tokens
            sequence.on_finish(self.time)

    def _sync(self, now: float) -> None:
        """Bring the state to the first step boundary at or after `now`."""
        while self.running:
            to_finish = self._finishing[0][0] - self.steps
            to_now = self._steps_to_reach(now - self.time)
            steps = min(to_finish, to_now)
            if steps <= 0:
                return
            self._advance(steps)
            if steps == to_now:
                return
        self.time = max(self.time, now)

    def _admit(self) -> None:
        m = self.model
        while self.waiting and len(self.running) < m.max_sequences and (
                self.reserved_tokens + self.waiting[0].reserved_tokens <= m.kv_capacity_tokens
                or not self.running):
            sequence = self.waiting.popleft()
            sequence.join_step = self.steps
            self.running[id(sequence)] = sequence
            heapq.heappush(self._finishing,
                           (self.steps + sequence.request.output_tokens, id(sequence)))
            self.context_tokens += sequence.request.prompt_tokens
            self.reserved_tokens += sequence.reserved_tokens
            self._awaiting_first.append(sequence)

    def _schedule(self) -> None:
        self._version += 1
        if not self.running:
            return
        version = self._version
        at = self.time + self._duration(self._finishing[0][0] - self.steps)
        self.loop.at(at, lambda: self._on_event(version))

    def _on_event(self, version: int) -> None:
        if version != self._version:
            return
        self._sync(self.loop.now)
        self._admit()
        self._factor = self.slowdown()
        self._schedule()
