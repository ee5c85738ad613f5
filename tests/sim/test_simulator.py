"""The simulator's parts against references written the slow, obvious way."""

from __future__ import annotations

import random

import pytest
from disagg_operator.performance import DecodeModel, PrefillModel
from disagg_sim.cache import BlockCache
from disagg_sim.cluster import POLICIES, Cluster
from disagg_sim.engines import DecodeInstance, PrefillInstance, PrefillJob, Sequence
from disagg_sim.events import EventLoop
from disagg_sim.profile import load_profile, parse_profile
from disagg_sim.simulate import simulate
from disagg_sim.trace import (
    CONVERSATION_TRACE,
    Request,
    TraceRow,
    apply_rate_steps,
    parse_rate_steps,
    read_trace,
    scaled_arrivals,
    to_requests,
)

TRACE = CONVERSATION_TRACE
DECODE = DecodeModel(base_s=0.01, per_sequence_s=0.002, per_context_token_s=1e-5,
                     max_sequences=3, kv_capacity_tokens=10_000)


def request(ident: int, arrival: float, prompt: int, output: int,
            keys: tuple[int, ...] = ()) -> Request:
    return Request(ident, arrival, prompt, output, keys, 32)


def reference_decode(model: DecodeModel, arrivals: list[tuple[float, Request]]
                     ) -> dict[int, tuple[float, float]]:
    """One step at a time: who runs, how long the step takes, who finishes."""
    pending = sorted(arrivals, key=lambda a: a[0])
    running: list[list[float]] = []  # [id, prompt, generated, output, reserved]
    waiting: list[Request] = []
    out: dict[int, list[float]] = {}
    now = 0.0
    while pending or running or waiting:
        while pending and pending[0][0] <= now + 1e-12:
            waiting.append(pending.pop(0)[1])
        reserved = sum(r[4] for r in running)
        while waiting and len(running) < model.max_sequences and (
                reserved + waiting[0].prompt_tokens + waiting[0].output_tokens
                <= model.kv_capacity_tokens or not running):
            r = waiting.pop(0)
            running.append([r.id, r.prompt_tokens, 0, r.output_tokens,
                            r.prompt_tokens + r.output_tokens])
            reserved += r.prompt_tokens + r.output_tokens
        if not running:
            now = pending[0][0]
            continue
        context = sum(r[1] + r[2] for r in running)
        now += model.base_s + model.per_sequence_s * len(running) + \
            model.per_context_token_s * context
        for r in running:
            r[2] += 1
            if r[2] == 1:
                out[int(r[0])] = [now, 0.0]
            if r[2] == r[3]:
                out[int(r[0])][1] = now
        running = [r for r in running if r[2] < r[3]]
    return {k: (v[0], v[1]) for k, v in out.items()}


@pytest.mark.parametrize("seed", range(20))
def test_decode_in_closed_form_matches_stepping_one_step_at_a_time(seed: int) -> None:
    rng = random.Random(seed)
    arrivals = [(rng.uniform(0, 2), request(i, 0, rng.randint(10, 3000), rng.randint(1, 60)))
                for i in range(rng.randint(1, 12))]
    loop = EventLoop()
    decode = DecodeInstance("d", DECODE, loop)
    seen: dict[int, list[float]] = {}
    for at, r in arrivals:
        def arrive(r: Request = r) -> None:
            seen[r.id] = [0.0, 0.0]
            decode.arrive(Sequence(r, lambda t, i=r.id: seen[i].__setitem__(0, t),
                                   lambda t, i=r.id: seen[i].__setitem__(1, t)))
        loop.at(at, arrive)
    loop.run()
    expected = reference_decode(DECODE, arrivals)
    # A sequence joins at the first step boundary at or after its arrival, as in vLLM.
    assert seen.keys() == expected.keys()
    for ident, (first, finish) in expected.items():
        assert seen[ident] == pytest.approx([first, finish], rel=1e-9, abs=1e-9), ident
    assert decode.idle and decode.reserved_tokens == 0
    assert decode.context_tokens == pytest.approx(0, abs=1e-6)


def test_prefill_chunks_the_queue_by_the_token_budget() -> None:
    model = PrefillModel(base_s=0.01, per_token_s=0.001, per_token_context_s=0.0,
                         max_batched_tokens=100)
    loop = EventLoop()
    prefill = PrefillInstance("p", model, loop)
    done: dict[int, float] = {}
    for ident, tokens in ((0, 150), (1, 30)):
        prefill.submit(PrefillJob(request(ident, 0, tokens, 1), 0,
                                  lambda t, i=ident: done.__setitem__(i, t)))
    loop.run()
    # Step 1: 100 tokens of request 0. Step 2: its last 50 and all 30 of request 1.
    assert done[0] == pytest.approx(0.11 + 0.09)
    assert done[1] == pytest.approx(done[0])
    assert prefill.idle and prefill.queued_tokens == 0


def test_a_step_reads_its_context_again_at_the_profiles_cost_per_context_token() -> None:
    """MLA on vLLM: a prompt whose first 512 tokens are cached still expands those 512 tokens'
    latents in the step that computes its last 16, and a prompt's second chunk its first."""
    model = PrefillModel(base_s=0.01, per_token_s=0.001, max_batched_tokens=100,
                         per_context_token_s=0.0001)
    loop = EventLoop()
    prefill = PrefillInstance("p", model, loop)
    done: list[float] = []
    prefill.submit(PrefillJob(request(0, 0, 528, 1), 512, done.append))
    loop.run()
    assert done == [pytest.approx(0.01 + 0.016 + 0.0512)]
    assert model.prompt_seconds(16, cached=512) == pytest.approx(done[0])
    prefill.submit(PrefillJob(request(1, 0, 150, 1), 0, done.append))
    loop.run()
    assert done[1] - done[0] == pytest.approx(0.11 + 0.06 + 0.01)
    assert model.prompt_seconds(150) == pytest.approx(done[1] - done[0])
    assert model.tokens_per_second(512, 50) == pytest.approx(100 / (0.11 + 2 * 0.0512))


def test_the_block_cache_evicts_the_least_recently_used() -> None:
    cache = BlockCache(3)
    cache.insert([1, 2, 3])
    assert cache.prefix_hits([1, 2], 5) == 2  # 1 and 2 used: 3 is now the oldest
    cache.insert([4])
    assert cache.prefix_hits([3], 5) == 0 and cache.prefix_hits([1, 2, 4], 5) == 3
    assert cache.evicted == 1


def test_trace_blocks_become_chained_keys_and_partial_blocks_are_not_reusable() -> None:
    rows = [TraceRow(0, 1100, 5, (7, 8, 9)), TraceRow(1000, 1024, 5, (7, 8)),
            TraceRow(2000, 600, 5, (9, 8))]
    first, second, third = to_requests(rows, block_tokens=32)
    assert first.prompt_tokens == 32 + 32 + round(76 / 512 * 32)
    assert len(first.block_keys) == 2 and first.block_keys == second.block_keys
    assert third.block_keys[0] != first.block_keys[0]  # same id, other prefix
    assert second.usable_blocks == 1  # the last token is always computed
    assert [r.arrival for r in (first, second, third)] == [0, 1, 2]


def test_engines_with_smaller_cache_blocks_reuse_what_a_partial_trace_block_shares() -> None:
    """vLLM's CPU build caches an MLA model in 16-token blocks while the replay maps each trace
    block to 32 tokens: a prompt ending in part of a trace block shares that part's first
    16-token blocks with a prompt that holds the whole trace block after the same prefix."""
    rows = [TraceRow(0, 1024, 5, (7, 8)), TraceRow(1000, 1024 + 300, 5, (7, 8, 9)),
            TraceRow(2000, 1536, 5, (7, 8, 9))]
    whole, partial, longer = to_requests(rows, block_tokens=32, cache_block=16)
    assert partial.prompt_tokens == 64 + round(300 / 512 * 32)  # 19 tokens of block 9
    assert len(whole.block_keys) == 4 and partial.block_keys[:4] == whole.block_keys
    assert len(partial.block_keys) == 5 and longer.block_keys[:5] == partial.block_keys
    assert partial.usable_blocks == 5 and partial.block_tokens == 16
    assert len(to_requests(rows, block_tokens=32)[1].block_keys) == 2  # 32: not reusable
    with pytest.raises(ValueError, match="divide"):
        to_requests(rows, block_tokens=32, cache_block=12)


def test_rate_steps_repeat_or_thin_whole_conversations_and_keep_the_timeline() -> None:
    rows = [TraceRow(1000.0 * t, 1024, 5, (0, conversation, 100 * conversation + t))
            for t in range(30) for conversation in range(1, 41)]
    steps = parse_rate_steps("0:1,10:3,20:0.5")
    out = apply_rate_steps(rows, steps, copy_offset_ms=100)
    per_segment = [sum(a <= r.timestamp_ms / 1000 < b for r in out)
                   for a, b in ((0, 10), (10, 20), (20, 30))]
    assert per_segment[:2] == [400, 1200]
    assert 100 <= per_segment[2] <= 300  # about half of 400
    kept = {r.hash_ids[1] for r in out if r.timestamp_ms >= 20_000}
    for conversation in kept:  # a thinned conversation keeps all its later turns
        assert sum(r.hash_ids[1] == conversation for r in out if r.timestamp_ms >= 20_000) == 10
    copies = [r for r in out if r.timestamp_ms == 15_000 + 100]
    assert copies and all(r.hash_ids[0] == 0 and r.hash_ids[1] not in range(1, 41)
                          for r in copies)  # other users: same system prompt, own blocks
    assert scaled_arrivals(rows[:3], scale=2)[-1] == 0
    with pytest.raises(ValueError, match="SECOND:FACTOR"):
        parse_rate_steps("0:1,100")


def small_profile(**changes: object) -> dict[str, object]:
    return {"name": "test", "prefill": {"base_s": 0.005, "per_token_s": 1e-5},
            "decode": {"base_s": 0.01, "per_sequence_s": 1e-4, "per_context_token_s": 1e-8},
            "transfer": {"bytes_per_token": 1000, "bandwidth_bytes_per_s": 1e9},
            "store_capacity_bytes": 1e12, **changes}


def conversation_requests(turns: int = 30) -> list[Request]:
    """Conversations whose every turn extends the previous one by two blocks."""
    rows = []
    for conversation in range(10):
        ids: tuple[int, ...] = (1000 + conversation,)
        for turn in range(turns // 10):
            ids = (*ids, conversation * 100 + 2 * turn, conversation * 100 + 2 * turn + 1)
            rows.append(TraceRow(1000.0 * (turn * 10 + conversation), len(ids) * 512, 4, ids))
    rows.sort(key=lambda r: r.timestamp_ms)
    return to_requests(rows, block_tokens=32)


def ideal_share(requests: list[Request]) -> float:
    seen: set[int] = set()
    computed = 0
    for r in requests:
        hits = 0
        while hits < r.usable_blocks and r.block_keys[hits] in seen:
            hits += 1
        computed += r.prompt_tokens - hits * r.block_tokens
        seen.update(r.block_keys)
    return computed / sum(r.prompt_tokens for r in requests)


def test_store_aware_computes_what_an_unbounded_cluster_cache_would() -> None:
    requests = conversation_requests()
    profile = parse_profile(small_profile(engine_prefix_cache=False))
    summary, _ = simulate(profile, requests, "store-aware", 2, 2)
    assert summary.finished == len(requests)
    assert summary.computed_share == pytest.approx(ideal_share(requests))
    no_reuse, _ = simulate(profile, requests, "round-robin", 2, 2)
    assert no_reuse.computed_share == 1.0
    assert summary.ttft_p50 < no_reuse.ttft_p50


def test_prefill_reads_its_store_hits_at_the_store_loads_cost_not_the_hand_overs() -> None:
    """A prefill instance loading its own store hits pays the profile's store load; the
    transfer's latency (the hand-over to decode, through the proxy) only once per request."""
    requests = [request(0, 0.0, 320, 2, tuple(range(10))),
                request(1, 10.0, 384, 2, tuple(range(12)))]  # 10 stored blocks, 2 new
    slow_hand_over = {"bytes_per_token": 1000, "bandwidth_bytes_per_s": 1e9, "latency_s": 0.5}
    fallback = parse_profile(small_profile(transfer=slow_hand_over, engine_prefix_cache=False))
    own = parse_profile(small_profile(transfer=slow_hand_over, engine_prefix_cache=False,
                                      store_load={"bytes_per_token": 1000,
                                                  "bandwidth_bytes_per_s": 1e9,
                                                  "latency_s": 0.001}))
    assert own.store_load_seconds(320) == pytest.approx(0.001 + 320e-6)
    assert fallback.store_load_seconds(320) == fallback.transfer.seconds(320)
    ttft = {}
    for name, profile in (("fallback", fallback), ("own", own)):
        _, cluster = simulate(profile, requests, "store-aware", 1, 1)
        hit = cluster.outcomes[1]
        assert hit.route == "prefill" and hit.computed_tokens == 64
        ttft[name] = hit.ttft
    assert ttft["fallback"] - ttft["own"] == pytest.approx(0.5 - 0.001, abs=1e-6)
    with pytest.raises(ValueError, match="store_load"):
        parse_profile(small_profile(store_load={"latency": 1}))


def test_store_hits_are_read_in_the_step_that_computes_the_rest_unless_the_profile_says(
        ) -> None:
    """kvhelper's prefill reads its store hits inside the step (lookup_load_async: false): a
    cold prompt in the same step waits for that read too. Read beside the compute, it does
    not; and blocks the instance's own prefix cache holds are not read at all."""
    stored = tuple(range(10))
    requests = [request(0, 0.0, 320, 2, stored),
                request(1, 10.0, 384, 2, (*stored, 10, 11)),  # 10 stored blocks, 2 new
                request(2, 10.0, 64, 2, (50, 51))]  # cold, arrives with it
    load = {"bytes_per_token": 1000, "bandwidth_bytes_per_s": 1e9, "latency_s": 0.2}
    cold_ttft = {}
    for in_step in (True, False):
        profile = parse_profile(small_profile(engine_prefix_cache=False, store_load=load,
                                              store_load_in_step=in_step))
        _, cluster = simulate(profile, requests, "store-aware", 1, 1)
        cold_ttft[in_step] = cluster.outcomes[2].ttft
    assert cold_ttft[True] - cold_ttft[False] == pytest.approx(0.2 + 320e-6, abs=0.02)
    own_cache = parse_profile(small_profile(store_load=load))  # the prefill's cache holds it
    _, cluster = simulate(own_cache, requests, "store-aware", 1, 1)
    assert cluster.outcomes[2].ttft < cold_ttft[True] - 0.15  # no read in its step
    assert cluster.outcomes[1].computed_tokens == 64


def test_instances_sharing_the_cores_run_their_steps_slower_while_others_compute() -> None:
    """Processor sharing (vLLM's CPU build, every engine on the same cores): a step takes the
    number of instances computing when it starts (prefill) or at the batch's event (decode)
    times as long; instances of their own (GPUs) never slow each other."""
    loop = EventLoop()
    busy = [1.0]
    model = PrefillModel(base_s=0.005, per_token_s=1e-5)
    prefill = PrefillInstance("p", model, loop, slowdown=lambda: busy[0])
    done: list[float] = []
    prefill.submit(PrefillJob(request(0, 0.0, 1000, 1), 0, done.append))
    busy[0] = 2.0
    prefill.submit(PrefillJob(request(1, 0.0, 1000, 1), 0, done.append))
    loop.run()
    alone = model.step_seconds(1000, 1000 * 500)
    assert done == pytest.approx([alone, alone + 2 * model.step_seconds(1000, 1000 * 500)])
    decode = DecodeInstance("d", DECODE, loop, time=loop.now, slowdown=lambda: busy[0])
    first: list[float] = []
    start = loop.now
    decode.arrive(Sequence(request(2, start, 100, 1), first.append, lambda _: None))
    loop.run()
    assert first == pytest.approx([start + 2 * (DECODE.base_s + DECODE.per_sequence_s
                                                 + DECODE.per_context_token_s * 100)])
    profile = small_profile(engine_prefix_cache=False)
    for shared in (False, True):
        cluster = Cluster(parse_profile({**profile, "shared_cores": shared}), "least-loaded", 32)
        cluster.add("prefill", 2)
        cluster.add("decode", 1)
        for ident in range(2):
            cluster.submit(request(ident, 0.0, 1000, 1))
        cluster.loop.run(until=0.001)
        assert [p.busy for p in cluster.prefills] == [True, True]
        assert [p.slowdown() for p in cluster.prefills] == [2.0 if shared else 1.0] * 2


def test_a_small_store_evicts_and_reuses_less() -> None:
    requests = conversation_requests()
    roomy = parse_profile(small_profile(engine_prefix_cache=False))
    tiny = parse_profile(small_profile(engine_prefix_cache=False,
                                       store_capacity_bytes=4 * 32 * 1000))
    full, _ = simulate(roomy, requests, "store-aware", 2, 2)
    small, cluster = simulate(tiny, requests, "store-aware", 2, 2)
    assert small.computed_share > full.computed_share and cluster.store.evicted > 0


def test_the_kv_router_follows_each_engines_own_cache() -> None:
    requests = conversation_requests()
    profile = parse_profile(small_profile())
    routed, _ = simulate(profile, requests, "kv-router", 4, 2)
    spread, _ = simulate(profile, requests, "round-robin", 4, 2)
    assert routed.computed_share < spread.computed_share


def test_new_instances_serve_after_their_start_up_and_leaving_ones_drain() -> None:
    profile = parse_profile(small_profile())
    cluster = Cluster(profile, "least-loaded", 32)
    cluster.add("prefill", 1)
    cluster.add("decode", 1)
    cluster.loop.run(until=0)
    cluster.add("decode", 1, delay=5.0)
    for ident in range(6):
        cluster.submit(request(ident, 0.1 * ident, 64, 200))
    cluster.loop.run(until=1.0)
    assert (cluster.serving("decode"), cluster.provisioned("decode")) == (1, 2)
    cluster.remove("decode", 1)  # the one still starting is taken back first
    assert cluster.provisioned("decode") == 1
    cluster.add("decode", 1)
    cluster.loop.run(until=1.5)
    assert [d.name for d in cluster.decodes] == ["decode-1", "decode-3"]
    for ident in range(6, 12):
        cluster.submit(request(ident, 1.6 + 0.01 * ident, 64, 200))
    cluster.loop.run(until=1.8)
    draining = cluster.decodes[1]
    assert draining.outstanding > 0
    cluster.remove("decode", 1)  # drains the newest: it keeps its sequences, gets no more
    assert draining.draining and draining in cluster.decodes
    cluster.loop.run()
    assert all(o.finish is not None for o in cluster.outcomes)
    assert [d.name for d in cluster.decodes] == ["decode-1"]  # decode-2 never served
    hours = cluster.instance_seconds["decode"]
    assert 1.0 + draining.busy_seconds <= hours < cluster.loop.now + 5.0


def test_unknown_profile_fields_and_policies_are_named() -> None:
    with pytest.raises(ValueError, match="unknown field"):
        parse_profile(small_profile(gpus=8))
    with pytest.raises(ValueError, match="choose one of"):
        Cluster(parse_profile(small_profile()), "random", 32)
    with pytest.raises(FileNotFoundError, match="deepseek-v3-h200"):
        load_profile("no-such-profile")


def test_the_whole_trace_replays_with_every_policy() -> None:
    requests = to_requests(read_trace(TRACE))
    profile = load_profile("deepseek-v3-h200")
    shares = {}
    for policy in POLICIES:
        summary, _ = simulate(profile, requests, policy, 4, 4)
        assert summary.finished == summary.requests == 12_031
        shares[policy] = summary.computed_share
    # The trace's own figure: 36.6% of prompt blocks repeat an earlier block.
    assert shares["store-aware"] == pytest.approx(1 - 0.366, abs=0.01)
    assert shares["store-aware"] < shares["kv-router"] < shares["round-robin"]
