"""What the connector's two sides share: the transfer parameters prefill hands decode (through
the client's response and the proxy), the per-step metadata the scheduler side sends the
workers, and the scheduler side's one record per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvhelper.transfer_params import IDENTITY_KEY as IDENTITY_KEY
from kvhelper.transfer_params import KEY_SPACE_KEY as KEY_SPACE_KEY
from kvhelper.transfer_params import PREFIX_HASH_KEY as PREFIX_HASH_KEY
from kvhelper.transfer_params import TOKENS_KEY

if TYPE_CHECKING:
    from vllm.v1.request import Request

# In kv_transfer_params (their one home is kvhelper.transfer_params).
PARAMS_KEY = TOKENS_KEY


@dataclass
class Transfer:
    """Blocks of one request to store or load: their hashes (hex, in order) and block ids."""
    req_id: str
    block_hashes: list[str]
    block_ids: list[int]
    # A finished request whose blocks vLLM holds until this store is done (decode saving):
    # the worker reports it back as sent, and vLLM frees them.
    release: bool = False
    # A load of pages prefill may still be writing (its stores are asynchronous): seconds to
    # wait for them to appear before the missing ones count as failed.
    wait_seconds: float = 0.0
    # A load on the loader thread (the request waits in WAITING_FOR_REMOTE_KVS), or one that
    # ends inside the step, before its forward.
    asynchronous: bool = True


@dataclass
class LoadOutcome:
    """What reading one request's pages gave: the first `good` blocks are in place."""
    load: Transfer
    good: int
    errors: list[int]  # store error codes of the failed keys
    seconds: float
    waited: float = 0.0  # of those, waiting for pages prefill was still storing


@dataclass
class SaveOutcome:
    """What storing one request's pages gave (counted on the step's thread)."""
    save: Transfer
    stored: int  # values written
    skipped: int  # values the store already held
    failed: dict[str, int]  # keys not written, with store error codes
    seconds: float


@dataclass
class MooncakeStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    # Requests vLLM preempted in this step: it has freed their blocks and may write them in
    # this step's forward, so their asynchronous stores must end before it.
    preempted: list[str] = field(default_factory=list)


@dataclass
class RequestRecord:
    """The scheduler side's state of one request, from the first time vLLM asks about it to
    `request_finished`."""
    request: Request
    block_ids: list[int] = field(default_factory=list)
    # Set when vLLM is told tokens can be loaded: the local prefix-cache hit vLLM passed then,
    # after which the load starts (vLLM sets request.num_computed_tokens only later).
    local_hit_tokens: int | None = None
    load_scheduled: bool = False  # loaded once: a preempted and resumed request recomputes
    refused: bool = False  # prefill's pages cannot be used here
    # (first block asked from, blocks found) of the store lookup: vLLM asks again each step
    # while it cannot allocate a request's blocks, and the store is asked once.
    stored_prefix: tuple[int, int] | None = None
    saved_tokens: int | None = None  # producer: prompt tokens decode can load
    wait_seconds: float = 0.0  # consumer: how long to wait for pages prefill still writes
    load_async: bool = True  # whether the load vLLM was told of is asynchronous
    prefix_hash: str | None = None  # producer: hex hash of the last of those blocks
