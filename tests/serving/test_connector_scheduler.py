"""The connector's scheduler side on its own, without an engine: requests and scheduler outputs
are stand-ins with the fields vLLM's scheduler fills (named as such); the real engine runs in
test_connector.py, test_prefix_hits.py and test_preemption.py."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any

import pytest
from kvhelper.connector.data import IDENTITY_KEY, KEY_SPACE_KEY, PARAMS_KEY, PREFIX_HASH_KEY
from kvhelper.connector.lookup import StoreHandshake
from kvhelper.connector.scheduler import SchedulerSide
from kvhelper.connector.settings import ConnectorSettings, SettingsError
from kvhelper.connector_metrics import TransferStats
from kvhelper.keys import block_key
from kvhelper.store import MooncakeConfig, StoreError
from kvhelper.stored_prefix import KeySpace, StoredPrefixLookup
from kvhelper.transfer_params import STORED_HINT_KEY, STORING_KEY

BLOCK = 16
IDENTITY = {"model": "m", "mla": True, "block_size": BLOCK}


def request(req_id: str, tokens: int, params: dict[str, Any] | None = None) -> Any:
    """A stand-in for vllm.v1.request.Request: chained hashes of its full blocks."""
    return SimpleNamespace(request_id=req_id, num_prompt_tokens=tokens, num_computed_tokens=0,
                           block_hashes=[bytes([i]) * 8 for i in range(tokens // BLOCK)],
                           kv_transfer_params=params)


def blocks(ids: list[int]) -> Any:
    return SimpleNamespace(get_block_ids=lambda: (list(ids),))


def step(scheduled: dict[str, int], cached: dict[str, list[int]] | None = None,
         resumed: set[str] | None = None, preempted: set[str] | None = None) -> Any:
    """A stand-in for SchedulerOutput: tokens scheduled per request, new blocks of running ones,
    requests preempted in this step."""
    cached = cached or {}
    return SimpleNamespace(num_scheduled_tokens=scheduled, scheduled_cached_reqs=SimpleNamespace(
        req_ids=list(cached), new_block_ids=[(ids,) for ids in cached.values()],
        resumed_req_ids=resumed or set()), preempted_req_ids=preempted or set())


def side(producer: bool = False, consumer: bool = False) -> SchedulerSide:
    return SchedulerSide(BLOCK, producer, consumer, IDENTITY, load_async=True,
                         stats=TransferStats())


def decode_params(stored_tokens: int) -> dict[str, Any]:
    return {"do_remote_prefill": True, PARAMS_KEY: stored_tokens, IDENTITY_KEY: IDENTITY,
            PREFIX_HASH_KEY: (bytes([stored_tokens // BLOCK - 1]) * 8).hex()}


def test_where_loaded_context_would_change_answers_nothing_is_loaded() -> None:
    """The guard (kvhelper.vllm_cpu_rope): on an MLA engine whose rotary kernel is left
    unfixed, decode computes every prompt itself."""
    consumer = SchedulerSide(BLOCK, False, True, IDENTITY, load_async=True,
                             stats=TransferStats(), loads_exact=False)
    req = request("r", 10 * BLOCK + 3, decode_params(10 * BLOCK))
    assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
    assert side(consumer=True).get_num_new_matched_tokens(req, 0) == (10 * BLOCK, True)


@pytest.mark.parametrize("local_blocks", [0, 2, 9, 10])
def test_loads_start_after_the_local_prefix_hit(local_blocks: int) -> None:
    consumer = side(consumer=True)
    req = request("r", 10 * BLOCK + 3, decode_params(10 * BLOCK))
    params = copy.deepcopy(req.kv_transfer_params)
    external, load_async = consumer.get_num_new_matched_tokens(req, local_blocks * BLOCK)
    assert external == (10 - local_blocks) * BLOCK and load_async == (external > 0)
    assert req.kv_transfer_params == params  # asking has no side effect on the request
    ids = [100 + i for i in range(11)]
    consumer.update_state_after_alloc(req, blocks(ids), external)
    meta = consumer.build_connector_meta(step({}))
    if local_blocks == 10:
        assert meta.loads == []
        return
    (load,) = meta.loads
    assert load.block_ids == ids[local_blocks:10]  # never a block the request had cached
    assert load.block_hashes == [h.hex() for h in req.block_hashes[local_blocks:10]]


def test_a_request_is_loaded_once_and_recomputes_when_resumed() -> None:
    consumer = side(consumer=True)
    req = request("r", 4 * BLOCK + 1, decode_params(4 * BLOCK))
    external, _ = consumer.get_num_new_matched_tokens(req, 0)
    consumer.update_state_after_alloc(req, blocks([1, 2, 3, 4, 5]), external)
    assert len(consumer.build_connector_meta(step({})).loads) == 1
    # Preempted and resumed: vLLM asks again; the pages may be gone, so it recomputes.
    assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
    consumer.update_state_after_alloc(req, blocks([6, 7, 8, 9, 10]), 0)
    assert consumer.build_connector_meta(step({})).loads == []


def test_an_incompatible_prefill_is_refused_once_without_touching_the_request() -> None:
    consumer = side(consumer=True)
    params = {**decode_params(4 * BLOCK), IDENTITY_KEY: {**IDENTITY, "block_size": 64}}
    req = request("r", 4 * BLOCK + 1, params)
    assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
    assert consumer.get_num_new_matched_tokens(req, 0) == (0, False)
    assert req.kv_transfer_params == params
    assert consumer.stats.take().data["requests_refused"] == 1  # type: ignore[union-attr]


def test_external_tokens_the_connector_did_not_offer_are_refused_loudly() -> None:
    consumer = side(consumer=True)
    with pytest.raises(RuntimeError, match="did not offer"):
        consumer.update_state_after_alloc(request("r", 3 * BLOCK), blocks([1, 2, 3]), BLOCK)


def test_prefill_stores_a_chunked_and_preempted_prompt_from_its_current_blocks() -> None:
    producer = side(producer=True)
    req = request("r", 5 * BLOCK + 4, {"do_remote_decode": True})  # 5 full blocks
    producer.update_state_after_alloc(req, blocks([1, 2]), 0)
    assert producer.build_connector_meta(step({"r": 2 * BLOCK})).saves == []  # first chunk
    # Preempted (vLLM starts it again from token 0), then resumed in other blocks: vLLM gives
    # the connector all of them, at allocation and again as the step's resumed blocks.
    producer.update_state_after_alloc(req, blocks([7, 8]), 0)
    producer.build_connector_meta(step({"r": 2 * BLOCK}, {"r": [7, 8]}, resumed={"r"}))
    req.num_computed_tokens = 2 * BLOCK
    meta = producer.build_connector_meta(step({"r": 3 * BLOCK + 4}, {"r": [9, 10, 11, 12]}))
    (save,) = meta.saves
    assert save.block_ids == [7, 8, 9, 10, 11]
    assert save.block_hashes == [h.hex() for h in req.block_hashes]
    hold, params = producer.request_finished(req, [7, 8, 9, 10, 11, 12])
    assert not hold  # its prompt was stored in the step that finished it
    assert params is not None and params[PARAMS_KEY] == 5 * BLOCK
    assert params[PREFIX_HASH_KEY] == req.block_hashes[4].hex()
    assert producer.request_finished(req, []) == (False, None)  # the record is gone


class FakeStore:
    """A stand-in for the Mooncake client (named as such): the keys it holds, or down."""

    def __init__(self, keys: set[str]) -> None:
        self.keys, self.down, self.asked = keys, False, 0

    def exists(self, keys: list[str], strict: bool = False) -> list[bool]:
        self.asked += 1
        if self.down:
            raise StoreError("checking which KV blocks are stored", -900)
        return [key in self.keys for key in keys]

    def close(self) -> None:
        pass


def lookup_over(store: FakeStore, clock: list[float] | None = None) -> StoredPrefixLookup:
    config = MooncakeConfig(master_server_address="127.0.0.1:1", local_hostname="127.0.0.1")
    now = clock or [0.0]
    return StoredPrefixLookup(config, connect=lambda _: store, clock=lambda: now[0])  # type: ignore[arg-type,return-value]


def producer_over(store: FakeStore) -> SchedulerSide:
    """A prefill scheduler side whose workers have said how its (MLA) keys are made."""
    producer = SchedulerSide(BLOCK, True, False, IDENTITY, load_async=False,
                             stats=TransferStats(), lookup=lookup_over(store))
    producer.set_layout(StoreHandshake("fp", None))
    return producer


def test_a_lookup_counts_leading_blocks_held_in_full_and_pauses_after_a_failure() -> None:
    hashes = [(bytes([i]) * 8).hex() for i in range(4)]
    held = {block_key("fp", h, (2, s)) for h in hashes[:3] for s in (0, 1)}
    held.discard(block_key("fp", hashes[2], (2, 1)))  # block 2 lacks a shard
    store, clock = FakeStore(held), [0.0]
    lookup, space = lookup_over(store, clock), KeySpace("fp", 2)
    assert lookup.stored_blocks(space, hashes) == 2
    assert lookup.stored_blocks(KeySpace("other", 2), hashes) == 0
    store.down = True
    assert lookup.stored_blocks(space, hashes) is None  # failed: computed, never held up
    asked = store.asked
    clock[0] = 5.0
    assert lookup.stored_blocks(space, hashes) == 0 and store.asked == asked  # paused
    store.down, clock[0] = False, 11.0
    assert lookup.stored_blocks(space, hashes) == 2


def test_prefill_loads_the_stored_blocks_after_its_own_cached_ones() -> None:
    req = request("r", 6 * BLOCK + 1, {"do_remote_decode": True})
    store = FakeStore({block_key("fp", h.hex()) for h in req.block_hashes[:5]})
    producer = producer_over(store)
    assert producer.get_num_new_matched_tokens(req, 2 * BLOCK) == (3 * BLOCK, False)
    producer.update_state_after_alloc(req, blocks(list(range(10, 17))), 3 * BLOCK)
    (load,) = producer.build_connector_meta(step({})).loads
    assert load.block_ids == [12, 13, 14]  # after the two blocks it had cached itself
    # Resumed after preemption: computed, not loaded again.
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)


def test_no_lookup_before_the_workers_say_how_keys_are_made() -> None:
    config = MooncakeConfig(master_server_address="127.0.0.1:1", local_hostname="127.0.0.1")
    store = FakeStore(set())
    lookup = StoredPrefixLookup(config, connect=lambda _: store)  # type: ignore[arg-type,return-value]
    producer = SchedulerSide(BLOCK, True, False, IDENTITY, load_async=True,
                             stats=TransferStats(), lookup=lookup)
    assert producer.get_num_new_matched_tokens(request("r", 5 * BLOCK), 0) == (0, False)
    assert store.asked == 0


def test_decode_saving_holds_a_finished_requests_blocks_until_they_are_stored() -> None:
    consumer = SchedulerSide(BLOCK, False, True, IDENTITY, load_async=True,
                             stats=TransferStats(), save_decode_cache=True)
    req = request("r", 3 * BLOCK, decode_params(2 * BLOCK))
    # Generated 2 blocks and 3 tokens more; the last sampled token has no KV yet.
    req.block_hashes = [bytes([i]) * 8 for i in range(5)]
    req.num_computed_tokens = 5 * BLOCK + 2
    hold, params = consumer.request_finished(req, [4, 5, 6, 7, 8, 9])
    assert hold and params is None
    (save,) = consumer.build_connector_meta(step({})).saves
    assert save.release and save.block_ids == [4, 5, 6, 7, 8]
    assert save.block_hashes == [h.hex() for h in req.block_hashes]
    assert consumer.build_connector_meta(step({})).saves == []  # sent once
    off = side(consumer=True)
    assert off.request_finished(req, [4, 5, 6, 7, 8, 9]) == (False, None)  # the default


def test_a_request_vllm_cannot_place_yet_asks_the_store_once() -> None:
    req = request("r", 6 * BLOCK + 1, {"do_remote_decode": True})
    store = FakeStore({block_key("fp", h.hex()) for h in req.block_hashes[:5]})
    producer = producer_over(store)
    for _ in range(3):  # no free blocks: vLLM asks again on each step
        assert producer.get_num_new_matched_tokens(req, 0) == (5 * BLOCK, False)
    assert store.asked == 1


@pytest.mark.parametrize("lookup_load_async", [False, True])
def test_own_store_hits_load_in_the_step_unless_set_and_decode_loads_stay_async(
        lookup_load_async: bool) -> None:
    """A prefill instance's own hits are read before the step's forward by default (vLLM
    would start an asynchronous load after it and schedule the request two steps later);
    decode's loads of prefill's pages stay asynchronous (load_async)."""
    req = request("r", 6 * BLOCK + 1, {"do_remote_decode": True})
    store = FakeStore({block_key("fp", h.hex()) for h in req.block_hashes[:4]})
    producer = SchedulerSide(BLOCK, True, False, IDENTITY, load_async=True,
                             stats=TransferStats(), lookup=lookup_over(store),
                             lookup_load_async=lookup_load_async)
    producer.set_layout(StoreHandshake("fp", None))
    assert producer.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, lookup_load_async)
    producer.update_state_after_alloc(req, blocks(list(range(7))), 4 * BLOCK)
    (load,) = producer.build_connector_meta(step({"r": 2 * BLOCK + 1})).loads
    assert load.asynchronous == lookup_load_async and load.block_ids == [0, 1, 2, 3]
    consumer = side(consumer=True)
    decode = request("d", 6 * BLOCK + 1, decode_params(6 * BLOCK))
    assert consumer.get_num_new_matched_tokens(decode, 0) == (6 * BLOCK, True)
    consumer.update_state_after_alloc(decode, blocks(list(range(7))), 6 * BLOCK)
    (load,) = consumer.build_connector_meta(step({})).loads
    assert load.asynchronous


def test_what_the_proxy_found_replaces_the_lookup_when_it_hashed_and_keyed_alike() -> None:
    req = request("r", 6 * BLOCK + 1)
    store = FakeStore({block_key("fp", h.hex()) for h in req.block_hashes[:5]})
    last = req.block_hashes[5].hex()

    def hinted(**changes: Any) -> tuple[int, int]:
        hint = {"tokens": 3 * BLOCK, "asked": 6, "last_hash": last,
                "key_space": {"fingerprint": "fp", "shards": None}, **changes}
        producer = producer_over(store)
        asked = store.asked
        tokens, _ = producer.get_num_new_matched_tokens(
            request("r", 6 * BLOCK + 1, {"do_remote_decode": True, STORED_HINT_KEY: hint}), 0)
        return tokens, store.asked - asked

    assert hinted() == (3 * BLOCK, 0)  # the proxy's answer, the store not asked
    assert hinted(tokens=0) == (0, 0)  # nothing stored when the proxy looked
    # Another hash of the last block asked (another tokenization, salt or hash seed), or
    # another instance's keys: the proxy's answer says nothing about these; ask the store.
    assert hinted(last_hash="00" * 8) == (5 * BLOCK, 1)
    assert hinted(key_space={"fingerprint": "other", "shards": None}) == (5 * BLOCK, 1)
    assert hinted(asked=9) == (5 * BLOCK, 1)
    assert hinted(tokens="3") == (5 * BLOCK, 1)


def test_prefill_tells_the_proxy_how_its_store_keys_are_made() -> None:
    producer = producer_over(FakeStore(set()))
    req = request("r", 3 * BLOCK + 1, {"do_remote_decode": True})
    assert producer.get_num_new_matched_tokens(req, 0) == (0, False)
    producer.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    producer.build_connector_meta(step({"r": 3 * BLOCK + 1}))
    _, params = producer.request_finished(req, [1, 2, 3, 4])
    assert params is not None
    assert KeySpace.from_json(params[KEY_SPACE_KEY]) == KeySpace("fp", None)
    assert KeySpace.from_json({"fingerprint": "fp", "shards": True}) is None


def test_asynchronous_stores_hold_the_blocks_and_tell_decode_to_wait_for_the_pages() -> None:
    producer = SchedulerSide(BLOCK, True, False, IDENTITY, load_async=True,
                             stats=TransferStats(), save_async=True)
    req = request("r", 3 * BLOCK + 1, {"do_remote_decode": True})
    producer.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    (save,) = producer.build_connector_meta(step({"r": 3 * BLOCK + 1})).saves
    assert not save.release  # the request runs on; the worker learns of its end from vLLM
    assert producer.build_connector_meta(step({}, preempted={"r"})).preempted == ["r"]
    hold, params = producer.request_finished(req, [1, 2, 3, 4])
    assert hold and params is not None and params[STORING_KEY] is True
    # Never stored (finished before its prompt completed): nothing to hold.
    early = request("e", 3 * BLOCK + 1, {"do_remote_decode": True})
    producer.update_state_after_alloc(early, blocks([5, 6, 7, 8]), 0)
    assert producer.request_finished(early, [5, 6, 7, 8]) == (False, None)

    consumer = SchedulerSide(BLOCK, False, True, IDENTITY, load_async=True,
                             stats=TransferStats(), store_wait_seconds=2.5)
    for storing, wait in ((True, 2.5), (False, 0.0)):
        waiting = request(f"d{storing}", 3 * BLOCK + 1,
                          {**decode_params(3 * BLOCK), STORING_KEY: storing})
        external, _ = consumer.get_num_new_matched_tokens(waiting, 0)
        consumer.update_state_after_alloc(waiting, blocks([1, 2, 3, 4]), external)
        (load,) = consumer.build_connector_meta(step({})).loads
        assert load.wait_seconds == wait  # the proxy's skip-prefill loads never wait


def test_synchronous_stores_hold_nothing() -> None:
    producer = side(producer=True)
    req = request("r", 3 * BLOCK + 1, {"do_remote_decode": True})
    producer.update_state_after_alloc(req, blocks([1, 2, 3, 4]), 0)
    meta = producer.build_connector_meta(step({"r": 3 * BLOCK + 1}, preempted={"r"}))
    assert meta.preempted == []
    hold, params = producer.request_finished(req, [1, 2, 3, 4])
    assert not hold and params is not None and STORING_KEY not in params


@pytest.mark.parametrize(("extra", "message"), [
    ({"save_async": "yes"}, "save_async must be true or false"),
    ({"store_wait_seconds": -1}, "store_wait_seconds must be a number of seconds"),
    ({"store_wait_seconds": True}, "store_wait_seconds must be a number of seconds"),
])
def test_settings_errors_name_the_setting(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        ConnectorSettings.parse(extra)
    defaults = ConnectorSettings.parse({})
    assert defaults.save_async and defaults.store_wait_seconds == 5.0
    assert ConnectorSettings.parse({"store_wait_seconds": 0}).store_wait_seconds == 0.0
