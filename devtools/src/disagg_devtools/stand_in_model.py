"""A deterministic stand-in for a language model (named as such), for the proxy's tests and
benchmarks that run without vLLM: each token is a function of every token id before it, so a
stream continued from its prompt and generated ids on another instance says what an
uninterrupted one says, and a client can tell a wrong continuation."""

from __future__ import annotations

import json
from typing import Any


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """The stand-in tokenizer: token ids as given, else one id per character."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        return [int(t) for t in prompt]
    text = prompt if isinstance(prompt, str) else json.dumps(body.get("messages"))
    return [ord(c) % 500 for c in text]


def next_token(ids: list[int]) -> int:
    """The stand-in model: a function of every id before it."""
    return (sum(i * (k + 1) for k, i in enumerate(ids)) * 31 + len(ids)) % 997


def token_text(token: int) -> str:
    return f"t{token} "


def expected_text(body: dict[str, Any], tokens: int) -> str:
    """What an uninterrupted stream of `tokens` tokens says."""
    ids, text = prompt_ids(body), ""
    for _ in range(tokens):
        token = next_token(ids)
        ids.append(token)
        text += token_text(token)
    return text
