"""A request's prompt as vLLM sees it: its token ids (the model's tokenizer, and for chat the
model's chat template, as vLLM's OpenAI server applies them) and the chained hashes of its full
blocks (vLLM's own hash functions, seed and extra keys), so that the proxy can ask the store
for exactly the keys the instances write.

Only requests whose tokens the proxy can reproduce exactly are tokenized here; anything else
(multimodal content, tools, a custom chat template, LoRA adapters, prompt batches) gets None,
and the proxy routes it as if this module did not exist.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# Request fields that change the prompt in ways only vLLM's own renderer reproduces.
UNSUPPORTED_FIELDS = ("tools", "chat_template", "documents", "mm_processor_kwargs",
                      "truncate_prompt_tokens", "prompt_embeds", "continue_final_message")
NON_CRYPTO_HASHES = frozenset({"xxhash", "xxhash_cbor"})


class Unsupported(Exception):
    """A request whose prompt tokens the proxy cannot reproduce exactly; the reason is a short
    metric label."""


@dataclass(frozen=True)
class TokenizerSource:
    name: str  # a Hugging Face model id or a local directory: the model's
    revision: str | None = None
    trust_remote_code: bool = False


def token_ids(chat: bool, body: dict[str, Any]) -> list[int] | None:
    """A completion's prompt given as token ids (vLLM takes them as they are), else None."""
    if chat or any(body.get(name) not in (None, False) for name in UNSUPPORTED_FIELDS):
        return None
    prompt = _single(body.get("prompt"))
    if isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    return None


def _single(prompt: Any) -> Any:
    """A batch of one prompt is that prompt."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        return prompt[0]
    return prompt


class PromptTokenizer:
    def __init__(self, source: TokenizerSource) -> None:
        from transformers import AutoTokenizer

        self._tokenizer = AutoTokenizer.from_pretrained(
            source.name, revision=source.revision, trust_remote_code=source.trust_remote_code)

    def tokens(self, chat: bool, body: dict[str, Any]) -> list[int]:
        """The prompt token ids vLLM computes for this request body."""
        if any(body.get(name) not in (None, False) for name in UNSUPPORTED_FIELDS):
            raise Unsupported("request_options")
        return self._chat(body) if chat else self._completion(body)

    def _completion(self, body: dict[str, Any]) -> list[int]:
        if (given := token_ids(False, body)) is not None:
            return given
        prompt = _single(body.get("prompt"))
        if not isinstance(prompt, str):
            raise Unsupported("prompt_batch")
        return list(self._tokenizer.encode(
            prompt, add_special_tokens=bool(body.get("add_special_tokens", True))))

    def _chat(self, body: dict[str, Any]) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise Unsupported("message_content")  # parts, images, tool calls: vLLM's to render
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise Unsupported("request_options")
        text = self._tokenizer.apply_chat_template(
            messages, tokenize=False,
            add_generation_prompt=bool(body.get("add_generation_prompt", True)), **kwargs)
        return list(self._tokenizer.encode(
            text, add_special_tokens=bool(body.get("add_special_tokens", False))))


class BlockHasher:
    """vLLM's chained block hashes of a token sequence, for one hash algorithm."""

    def __init__(self, algorithm: str) -> None:
        # vLLM's own functions: the proxy must hash exactly as the instances do.
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import hash_block_tokens, resolve_none_hash_seed

        if algorithm in NON_CRYPTO_HASHES and os.environ.get("PYTHONHASHSEED") is None:
            # vLLM seeds these randomly per process: nothing the proxy hashes could match.
            raise Unsupported("hash_seed")
        function: Callable[[Any], bytes] = get_hash_fn_by_name(algorithm)
        self._function = function
        self._hash_block: Callable[..., bytes] = hash_block_tokens
        # The first block's parent; PYTHONHASHSEED (rendered "0" everywhere) decides it.
        self._none_hash = function(resolve_none_hash_seed(function))

    def hashes(self, tokens: Sequence[int], block_size: int, blocks: int,
               cache_salt: str | None = None) -> list[str]:
        """Hex hashes of the first `blocks` full blocks; a `cache_salt` goes into the first
        block's hash, as vLLM does, so salted and unsalted prompts never share a key."""
        found: list[str] = []
        parent: bytes = self._none_hash
        for index in range(min(blocks, len(tokens) // block_size)):
            extra = (("cache_salt", cache_salt),) if index == 0 and cache_salt else None
            parent = self._hash_block(self._function, parent,
                                      tokens[index * block_size:(index + 1) * block_size],
                                      extra)
            found.append(bytes(parent).hex())
        return found
