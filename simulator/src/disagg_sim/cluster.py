"""An XpYd deployment under one routing policy: the proxy's decisions, the shared store, each
instance's own prefix cache, and scaling (instances start after a delay and drain on leaving).

Policies:
- `round-robin`: prefill and decode in turn; an instance reuses only its own prefix cache.
- `least-loaded`: the prefill with the fewest queued prompt tokens, the decode with the fewest
  outstanding sequences; own prefix cache only.
- `kv-router`: in the style of Dynamo's KV router: the prefill with the lowest
  `overlap_weight * blocks to compute there + queued blocks there`; own prefix cache only.
- `store-aware`: the KV-reuse issue's policy: every prefill reads the shared store first; a
  prompt the store holds whole skips prefill and goes straight to decode; otherwise the prefill
  with the least queued work after this request's cached blocks; least-outstanding decode.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import TypeVar

from disagg_sim.cache import BlockCache
from disagg_sim.engines import DecodeInstance, PrefillInstance, PrefillJob, Sequence, alone
from disagg_sim.events import EventLoop
from disagg_sim.profile import Profile
from disagg_sim.trace import Request

Instance = TypeVar("Instance", PrefillInstance, DecodeInstance)
POLICIES = ("round-robin", "least-loaded", "kv-router", "store-aware")


@dataclass
class Outcome:
    """What happened to one request."""
    request: Request
    route: str = ""  # prefill | skip_prefill
    computed_tokens: int = 0
    first_token: float | None = None
    finish: float | None = None
    # The proxy's phases: sent to prefill (or straight to decode), prefill done.
    sent: float | None = None
    prefilled: float | None = None

    @property
    def ttft(self) -> float:
        assert self.first_token is not None
        return self.first_token - self.request.arrival

    @property
    def itl(self) -> float:
        """Mean time between output tokens after the first."""
        assert self.first_token is not None and self.finish is not None
        return (self.finish - self.first_token) / max(1, self.request.output_tokens - 1)


@dataclass
class Cluster:
    profile: Profile
    policy: str
    block_tokens: int
    loop: EventLoop = field(default_factory=EventLoop)
    overlap_weight: float = 1.0
    prefills: list[PrefillInstance] = field(default_factory=list)
    decodes: list[DecodeInstance] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)
    instance_seconds: dict[str, float] = field(default_factory=lambda: {"prefill": 0.0,
                                                                         "decode": 0.0})

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy {self.policy!r}: choose one of {', '.join(POLICIES)}")
        self.store = BlockCache(self.profile.store_blocks(self.block_tokens))
        self._local: dict[str, BlockCache] = {}
        self._names = itertools.count()
        self._turn = {"prefill": 0, "decode": 0}
        self._started: dict[str, float] = {}
        self._starting: dict[str, str] = {}  # name -> role, scaled out and not serving yet
        self._cancelled: set[str] = set()

    # -- membership --------------------------------------------------------------------------

    def add(self, role: str, count: int, delay: float = 0.0) -> None:
        """`count` new instances of `role`, serving after `delay` seconds."""
        for _ in range(count):
            name = f"{role}-{next(self._names)}"
            self._started[name] = self.loop.now  # instances cost from the moment they start
            self._starting[name] = role
            self.loop.at(self.loop.now + delay, functools.partial(self._join, role, name))

    def _join(self, role: str, name: str) -> None:
        del self._starting[name]
        if name in self._cancelled:  # taken back while starting; its cost ended then
            self._cancelled.discard(name)
            return
        slowdown = self._busy_instances if self.profile.shared_cores else alone
        if role == "prefill":
            self.prefills.append(PrefillInstance(name, self.profile.prefill, self.loop,
                                                 slowdown))
            if self.profile.engine_prefix_cache:
                self._local[name] = BlockCache(self.profile.engine_cache_tokens
                                               // self.block_tokens)
        else:
            self.decodes.append(DecodeInstance(name, self.profile.decode, self.loop,
                                               time=self.loop.now, slowdown=slowdown))

    def remove(self, role: str, count: int) -> None:
        """Take `count` instances of `role` away: ones still starting first (they never serve),
        then serving ones drain: no new work, and they leave when idle."""
        starting = [n for n, r in self._starting.items() if r == role and n not in
                    self._cancelled]
        for name in starting[len(starting) - count:] if count else []:
            self._cancelled.add(name)
            self.instance_seconds[role] += self.loop.now - self._started.pop(name)
            count -= 1
        pool = self.prefills if role == "prefill" else self.decodes
        for instance in [i for i in pool if not i.draining][-count:] if count > 0 else []:
            instance.draining = True
        self._reap()

    def resize(self, role: str, count: int, delay: float = 0.0) -> None:
        """Add or take away instances of `role` until `count` are provisioned (new ones serve
        after `delay`)."""
        have = self.provisioned(role)
        if count > have:
            self.add(role, count - have, delay)
        elif count < have:
            self.remove(role, have - count)

    def _reap(self) -> None:
        for role, pool in (("prefill", self.prefills), ("decode", self.decodes)):
            for instance in [i for i in pool if i.draining and i.idle]:
                pool.remove(instance)  # type: ignore[arg-type]
                self.instance_seconds[role] += self.loop.now - self._started.pop(instance.name)

    def _busy_instances(self) -> float:
        """Instances computing now (shared cores: each step's slowdown), at least one."""
        return float(max(1, sum(p.busy for p in self.prefills)
                         + sum(bool(d.running) for d in self.decodes)))

    def serving(self, role: str) -> int:
        pool = self.prefills if role == "prefill" else self.decodes
        return sum(not i.draining for i in pool)

    def provisioned(self, role: str) -> int:
        """Serving, and starting without having been taken away again."""
        return self.serving(role) + sum(r == role and n not in self._cancelled
                                        for n, r in self._starting.items())

    def finish_accounting(self) -> None:
        for name, started in self._started.items():
            role = name.split("-", 1)[0]
            self.instance_seconds[role] += self.loop.now - started
        self._started = {name: self.loop.now for name in self._started}

    # -- requests ----------------------------------------------------------------------------

    def submit(self, request: Request) -> None:
        self.loop.at(request.arrival, lambda: self._arrive(request))

    def _arrive(self, request: Request) -> None:
        outcome = Outcome(request)
        self.outcomes.append(outcome)
        usable = request.usable_blocks
        bt = self.block_tokens
        prefills = [p for p in self.prefills if not p.draining]
        if self.policy == "store-aware":
            stored = self.store.prefix_hits(request.block_keys, usable)
            lookup = self.profile.store_lookup_s
            if usable and stored == usable and self._decodes():
                outcome.route = "skip_prefill"
                outcome.computed_tokens = request.prompt_tokens - stored * bt
                outcome.sent = self.loop.now + lookup
                load = self.profile.transfer.seconds(stored * bt)
                self.loop.at(self.loop.now + lookup + load, lambda: self._to_decode(outcome))
                return
            local = {p.name: self._local_hits(p, request, touch=False) for p in prefills}
            chosen = min(prefills, key=lambda p: p.expected_tokens + request.prompt_tokens
                         - max(stored, local[p.name]) * bt)
            hits = max(stored, local[chosen.name])
            # Only the stored blocks past its own cache's hit are read from the store.
            read = max(0, stored - local[chosen.name]) * bt
            load = self.profile.store_load_seconds(read) if read else 0.0
            self._local_hits(chosen, request)  # a use, for its LRU order
        else:
            if self.policy == "round-robin":
                chosen = self._in_turn("prefill", prefills)
            elif self.policy == "least-loaded":
                chosen = min(prefills, key=lambda p: p.expected_tokens)
            else:  # kv-router
                total = -(-request.prompt_tokens // bt)
                chosen = min(prefills, key=lambda p: self.overlap_weight * (
                    total - self._local_hits(p, request, touch=False)) + p.expected_tokens / bt)
            hits = self._local_hits(chosen, request)
            lookup = load = 0.0
        outcome.route = "prefill"
        outcome.computed_tokens = request.prompt_tokens - hits * bt
        outcome.sent = self.loop.now + lookup
        job = PrefillJob(request, hits * bt, lambda _t: self._prefilled(chosen, outcome))
        if self.profile.store_load_in_step:
            job.load_seconds = load  # the instance reads them in the step that computes it
        else:
            lookup += load  # read before it joins the queue, while the instance computes
        chosen.expect(job)
        self.loop.at(self.loop.now + lookup, lambda: chosen.submit(job))

    def _local_hits(self, instance: PrefillInstance, request: Request, touch: bool = True
                    ) -> int:
        cache = self._local.get(instance.name)
        return cache.prefix_hits(request.block_keys, request.usable_blocks, touch) if cache else 0

    def _prefilled(self, instance: PrefillInstance, outcome: Outcome) -> None:
        outcome.prefilled = self.loop.now
        keys = outcome.request.block_keys
        if (cache := self._local.get(instance.name)) is not None:
            cache.insert(keys)
        self.store.insert(keys)  # the prefill's pages go to the store in every policy
        self._reap()
        move = self.profile.transfer.seconds(outcome.request.prompt_tokens)
        self.loop.at(self.loop.now + move, lambda: self._to_decode(outcome))

    def _decodes(self) -> list[DecodeInstance]:
        return [d for d in self.decodes if not d.draining]

    def _to_decode(self, outcome: Outcome) -> None:
        decodes = self._decodes()
        if self.policy == "round-robin":
            chosen = self._in_turn("decode", decodes)
        else:
            chosen = min(decodes, key=lambda d: d.outstanding)

        def first(at: float) -> None:
            outcome.first_token = at

        def finish(at: float) -> None:
            outcome.finish = at
            self.loop.at(at, self._reap)

        chosen.arrive(Sequence(outcome.request, first, finish))

    def _in_turn(self, role: str, pool: list[Instance]) -> Instance:
        index = self._turn[role] % len(pool)
        self._turn[role] += 1
        return pool[index]
