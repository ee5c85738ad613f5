"""Routing on what the store holds: before a request is prefilled, the proxy tokenizes its
prompt, hashes its blocks as vLLM does and asks the store how many leading blocks it holds.

- Every block decode could load is stored, or what is not stored is at most
  `local_prefill_tokens` (conditional disaggregation: decode computes a short rest itself
  sooner than a prefill instance could take the request, load it and hand it over):
  **skip_prefill**. The request goes straight to a decode instance with the transfer
  parameters that make it load the stored blocks.
- Otherwise: **prefill**, on the prefill instance with the least expected work (what it has
  queued, plus what this prompt would cost there: the tokens it neither holds in its own
  prefix cache, as far as the proxy knows, nor can load, and a fraction of those it must
  load); the prefill instance loads whatever prefix the store holds beyond its own cache.
  The proxy tells it what its lookup found (`kvhelper_stored`), so the connector does not
  ask the store again inside vLLM's scheduler (it does when its own hash of the last block
  asked differs, or its keys are another's).
- Anything that keeps the proxy from knowing exactly (the tokenizer or vLLM's hashing not
  loaded, a request it cannot tokenize as vLLM would, no key space learned yet, the store not
  answering in time): **fallback**, today's route, counted by reason. A request never fails
  because of this feature; if decode cannot load what the proxy found (evicted meanwhile, or
  hashed differently), it computes the prompt itself.

What the proxy needs to know per KV fingerprint (block size, hash algorithm, the instances'
identity and store key space) it learns from prefill's own transfer parameters, so the first
request of a fingerprint always goes through prefill. Nothing about the store reaches a client:
only the proxy's aggregate metrics say what was found.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from kvhelper.proxy.brief_wait import BriefWait
from kvhelper.proxy.prompt_blocks import (
    BlockHasher,
    PromptTokenizer,
    TokenizerSource,
    Unsupported,
    token_ids,
)
from kvhelper.stored_prefix import KeySpace, LookupBusy, StoredPrefixLookup
from kvhelper.transfer_params import (
    IDENTITY_KEY,
    KEY_SPACE_KEY,
    PREFIX_HASH_KEY,
    TOKENS_KEY,
    load_from_store,
)

log = logging.getLogger("kvhelper.proxy")
RouteKind = Literal["skip_prefill", "prefill", "fallback"]
LOOKUP_THREADS = 4  # store lookups at once; a request finding them all busy falls back


@dataclass(frozen=True)
class Route:
    kind: RouteKind
    reason: str = ""  # why a fallback
    prompt_tokens: int = 0
    stored_tokens: int = 0  # leading prompt tokens whose blocks the store holds
    # skip_prefill: the decode fingerprint to use and what to tell decode.
    fingerprint: str | None = None
    params: dict[str, Any] | None = None
    # prefill: what the lookup found, for prefill's connector (transfer_params.STORED_HINT_KEY),
    # and the blocks it asked about, of `block_tokens` each (what the instance will then hold)
    hint: dict[str, Any] | None = None
    block_hashes: tuple[str, ...] = ()
    block_tokens: int = 0

    @property
    def uncached_tokens(self) -> int:
        return self.prompt_tokens - self.stored_tokens


@dataclass(frozen=True)
class Learned:
    """What prefill told about one KV fingerprint's instances."""
    block_size: int
    hash_algorithm: str
    identity: dict[str, Any]
    key_space: KeySpace

    @classmethod
    def from_params(cls, params: Any) -> Learned | None:
        if not isinstance(params, dict):
            return None
        identity, space = params.get(IDENTITY_KEY), KeySpace.from_json(params.get(KEY_SPACE_KEY))
        if not isinstance(identity, dict) or space is None:
            return None
        block_size, algorithm = identity.get("block_size"), identity.get("hash")
        if not isinstance(block_size, int) or block_size < 1 or not isinstance(algorithm, str):
            return None
        return cls(block_size, algorithm, identity, space)


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    salt: str | None


class StoreRouter:
    def __init__(self, tokenizer: TokenizerSource,
                 lookup: StoredPrefixLookup | Callable[[], StoredPrefixLookup],
                 lookup_timeout: float = 0.25,
                 on_lookup: Callable[[float], None] = lambda seconds: None,
                 local_prefill_tokens: int = 0, brief_wait: BriefWait | None = None) -> None:
        self._source = tokenizer
        self.local_prefill_tokens = local_prefill_tokens
        self._on_lookup = on_lookup
        self._lookup_factory = lookup if callable(lookup) else (lambda: lookup)
        self._lookup: StoredPrefixLookup | None = None
        self.lookup_timeout = lookup_timeout
        self._tokenizer: PromptTokenizer | None = None
        self._hashers: dict[str, BlockHasher | None] = {}
        self._learned: dict[str, Learned] = {}  # KV fingerprint -> what prefill told
        self._busy = 0
        self._brief_wait = brief_wait or BriefWait()
        self.ready = asyncio.Event()
        self.failed: str | None = None  # why it could not start

    async def start(self) -> None:
        """Load the tokenizer and vLLM's hashing (seconds: off the event loop)."""
        try:
            self._tokenizer = await asyncio.to_thread(PromptTokenizer, self._source)
            self._lookup = await asyncio.to_thread(self._lookup_factory)
            await asyncio.to_thread(self._hasher, "sha256")  # imports vLLM's hashing
            self.ready.set()
            log.info("store-aware routing ready (tokenizer %s)", self._source.name)
        except Exception as err:
            self.failed = f"{type(err).__name__}: {err}"
            log.warning("store-aware routing is off: %s; requests take the prefill route",
                        self.failed)

    def close(self) -> None:
        if self._lookup is not None:
            self._lookup.close()

    def _hasher(self, algorithm: str) -> BlockHasher | None:
        if algorithm not in self._hashers:
            try:
                self._hashers[algorithm] = BlockHasher(algorithm)
            except (Unsupported, ValueError) as err:
                log.warning("cannot hash prompts as the instances do (%s %s)", algorithm, err)
                self._hashers[algorithm] = None
        return self._hashers[algorithm]

    # -- learning from prefill -------------------------------------------------------------

    def learn(self, fingerprint: str, params: Any) -> None:
        """Take what a prefill instance of `fingerprint` returned for decode."""
        learned = Learned.from_params(params)
        if learned is not None and self._learned.get(fingerprint) != learned:
            log.info("store keys of fingerprint %s: %s", fingerprint, learned.key_space)
            self._learned[fingerprint] = learned

    def hash_agrees(self, prompt: Prompt | None, fingerprint: str, params: Any) -> bool | None:
        """Whether the proxy's hash of the prompt equals the one prefill reported for the last
        block decode will load; None when there is nothing to compare."""
        learned = self._learned.get(fingerprint)
        if prompt is None or learned is None or not isinstance(params, dict):
            return None
        tokens, theirs = params.get(TOKENS_KEY), params.get(PREFIX_HASH_KEY)
        if not isinstance(tokens, int) or not isinstance(theirs, str) or tokens <= 0:
            return None
        hasher = self._hasher(learned.hash_algorithm)
        if hasher is None:
            return None
        blocks = tokens // learned.block_size
        ours = hasher.hashes(prompt.tokens, learned.block_size, blocks, prompt.salt)
        return len(ours) == blocks and ours[-1] == theirs

    # -- routing ---------------------------------------------------------------------------

    async def decide(self, chat: bool, body: dict[str, Any], models: set[str],
                     fingerprints: set[str]) -> tuple[Route, Prompt | None]:
        """The route for a request that healthy decode instances of `fingerprints` could take,
        and its prompt when the proxy could tokenize it."""
        if not self.ready.is_set():
            return Route("fallback", "not_ready"), None
        known = sorted(f for f in fingerprints if f in self._learned)
        if not known:
            return Route("fallback", "not_learned"), None
        prompt = await self._prompt(chat, body, models)
        if isinstance(prompt, Route):
            return prompt, None
        return await self._route(prompt, known), prompt

    async def _prompt(self, chat: bool, body: dict[str, Any], models: set[str]
                      ) -> Prompt | Route:
        """The request's prompt tokens, or the fallback Route saying why there are none."""
        assert self._tokenizer is not None
        if body.get("model") not in models:
            return Route("fallback", "lora")  # an adapter's name: its hashes carry the adapter
        salt = body.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            return Route("fallback", "request_options")
        try:
            # Token ids need no tokenizer, so no thread either.
            tokens = (given if (given := token_ids(chat, body)) is not None
                      else await asyncio.to_thread(self._tokenizer.tokens, chat, body))
        except Unsupported as err:
            return Route("fallback", str(err))
        except Exception as err:  # a template that refuses these messages, ...
            log.debug("cannot tokenize a request: %s", err)
            return Route("fallback", "tokenizer_error")
        return Prompt(tokens, salt or None)

    async def _route(self, prompt: Prompt, fingerprints: list[str]) -> Route:
        """skip_prefill when some decode fingerprint's store holds every block decode could
        load, or all but `local_prefill_tokens` of the prompt; prefill otherwise; fallback
        when the store cannot tell."""
        total = len(prompt.tokens)
        best: Route | None = None
        for fingerprint in fingerprints:
            learned = self._learned[fingerprint]
            hasher = self._hasher(learned.hash_algorithm)
            if hasher is None:
                return Route("fallback", "hash_seed", total)
            # Decode computes at least the last prompt token itself.
            usable = (total - 1) // learned.block_size
            if usable <= 0:
                continue
            hashes = hasher.hashes(prompt.tokens, learned.block_size, usable, prompt.salt)
            found = await self._stored_blocks(learned.key_space, hashes)
            if found is None:
                return Route("fallback", "lookup_failed", total)
            if isinstance(found, str):
                return Route("fallback", found, total)
            stored = found * learned.block_size
            if found == usable or total - stored <= self.local_prefill_tokens:
                params = (load_from_store(stored, hashes[found - 1], learned.identity)
                          if found else None)  # nothing stored: decode computes it all
                return Route("skip_prefill", prompt_tokens=total, stored_tokens=stored,
                             fingerprint=fingerprint, params=params)
            if best is None or stored > best.stored_tokens:
                hint = {"tokens": stored, "asked": usable, "last_hash": hashes[-1],
                        "key_space": learned.key_space.to_json()}
                best = Route("prefill", prompt_tokens=total, stored_tokens=stored, hint=hint,
                             block_hashes=tuple(hashes), block_tokens=learned.block_size)
        return best or Route("prefill", prompt_tokens=total)

    async def _stored_blocks(self, space: KeySpace, hashes: list[str]) -> int | str | None:
        """Blocks found, None when the store failed, or the fallback reason."""
        lookup = self._lookup
        assert lookup is not None
        if lookup.paused:
            return "lookup_paused"  # it failed a moment ago
        if self._busy >= LOOKUP_THREADS:
            return "lookup_busy"  # every lookup thread waits on the store: do not queue
        started = time.perf_counter()
        try:
            pending = lookup.submit(space, hashes)
        except LookupBusy:
            return "lookup_busy"
        self._busy += 1
        # Straight onto the lookup's worker thread (one hand-over, not two), then a brief wait
        # for its answer here before the loop's own hand-over (brief_wait.py says why).
        future = asyncio.wrap_future(pending)
        future.add_done_callback(self._lookup_done)
        try:
            if self._brief_wait.done_soon(pending):
                return pending.result()
            return await asyncio.wait_for(asyncio.shield(future), self.lookup_timeout)
        except TimeoutError:
            return "lookup_timeout"
        except Exception:
            return None  # _lookup_done pauses lookups
        finally:
            self._on_lookup(time.perf_counter() - started)

    def _lookup_done(self, future: asyncio.Future[int]) -> None:
        self._busy -= 1
        if not future.cancelled() and (err := future.exception()) is not None:
            assert self._lookup is not None
            self._lookup.failed(err)
