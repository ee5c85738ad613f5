"""Continuing a stream on another decode instance when the one serving it fails after the client
has received tokens.

The proxy asks decode for the token ids of what it streams (vLLM's `return_token_ids`), keeps
the prompt's ids and the generated ones, and passes each event on, without those fields unless
the client asked for them. When the stream breaks, another decode instance gets a completions
request whose prompt is the prompt's ids followed by the generated ones, for the tokens still
due; its events are rewritten to look like the first stream's (its id, its created time, and
for a chat request chat chunks) and sent on the same response. A greedy answer continued this
way is the one the first instance would have given: the new instance computes the same tokens
from the same ids.

Requests whose rest cannot be reproduced from token ids are not continued, and end with an
error event as before: several choices, echo, stop strings (vLLM holds back text that may
start one, so what the client saw lags the tokens), structured output, tools, chat logprobs.
This module is pure: the proxy does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

DONE = b"[DONE]"
# msgspec, as in the proxy's app: every event of a continuable stream is parsed and written.
_decode = msgspec.json.Decoder().decode
_encode = msgspec.json.Encoder().encode
# vLLM's completions default when max_tokens is absent.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
# Chat request fields that carry over to the continuation's completions request.
CHAT_SAMPLING_FIELDS = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos", "logit_bias",
    "skip_special_tokens", "spaces_between_special_tokens", "stream_options", "user",
    "priority", "cache_salt")
# Completions request fields the continuation sets itself.
COMPLETIONS_REPLACED = ("prompt", "max_tokens", "min_tokens", "kv_transfer_params", "echo",
                        "suffix", "return_token_ids")
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice",
              "guided_grammar", "structured_outputs", "tools", "functions")


def why_not_continued(chat: bool, body: dict[str, Any]) -> str | None:
    """Why a streamed request cannot be continued from token ids; None when it can."""
    if not body.get("stream"):
        return "not streamed"
    if (body.get("n") or 1) != 1 or (body.get("best_of") or 1) != 1:
        return "several choices"
    if body.get("stop"):
        return "stop strings"
    if any(body.get(key) for key in STRUCTURED):
        return "structured output or tools"
    if chat and (body.get("logprobs") or body.get("top_logprobs")):
        return "chat logprobs"
    if not chat and (body.get("echo") or body.get("suffix")
                     or not isinstance(body.get("prompt"), (str, list))
                     or (isinstance(body.get("prompt"), list) and body["prompt"]
                         and not isinstance(body["prompt"][0], int))):
        return "echo, suffix or several prompts"
    return None


def split_events(buffer: bytearray) -> list[bytes]:
    """The complete SSE events at the front of `buffer` (removed from it), without their
    blank-line terminators; a partial event stays."""
    events = []
    while (end := buffer.find(b"\n\n")) >= 0:
        events.append(bytes(buffer[:end]))
        del buffer[:end + 2]
    return events


def _data(event: bytes) -> bytes | None:
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            return line[5:].strip()
    return None


@dataclass
class StreamRecord:
    """What a stream has given the client so far, and how to continue it."""

    chat: bool
    body: dict[str, Any]  # the client's request, as decode got it
    client_wants_ids: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    finished: bool = False  # a finish_reason, or [DONE], was passed on
    text_chars: int = 0  # characters of completion text passed on (logprob offsets)
    identity: dict[str, Any] = field(default_factory=dict)  # id, created, model of chunk 1
    content_only: bool = True  # no reasoning or tool-call deltas seen (chat)

    def relay(self, event: bytes) -> bytes:
        """One event of the first stream: recorded, and returned as the client gets it."""
        data = _data(event)
        if data is None:
            return event + b"\n\n"
        if data == DONE:
            self.finished = True
            return event + b"\n\n"
        chunk = _decode(data)
        if not self.identity:
            self.identity = {k: chunk[k] for k in ("id", "created", "model") if k in chunk}
        self._record(chunk)
        return b"data: " + _encode(chunk) + b"\n\n"

    def relay_continuation(self, event: bytes) -> bytes | None:
        """One event of a continuation (a completions stream): recorded, rewritten as the
        first stream's; None for what the client must not see twice (the [DONE] comes once)."""
        data = _data(event)
        if data is None or data == DONE:
            if data == DONE:
                self.finished = True
                return b"data: [DONE]\n\n"
            return None
        chunk = _decode(data)
        choices = chunk.get("choices") or []
        for choice in choices:
            choice.pop("prompt_token_ids", None)
        self._record(chunk, continuation=True)
        if self.chat:
            chunk = self._as_chat(chunk)
        else:
            for choice in choices:
                offsets = (choice.get("logprobs") or {}).get("text_offset")
                if offsets:
                    choice["logprobs"]["text_offset"] = [o + self.text_chars for o in offsets]
        chunk.update(self.identity)
        if "usage" in chunk and chunk["usage"] and self.prompt_ids is not None:
            generated = len(self.generated)
            prompt = len(self.prompt_ids)
            chunk["usage"].update(prompt_tokens=prompt, completion_tokens=generated,
                                  total_tokens=prompt + generated)
        return b"data: " + _encode(chunk) + b"\n\n"

    def _record(self, chunk: dict[str, Any], continuation: bool = False) -> None:
        if not continuation and "prompt_token_ids" in chunk:  # chat: at the top level
            ids = chunk.get("prompt_token_ids")
            if ids is not None:
                self.prompt_ids = list(ids)
            if not self.client_wants_ids:
                chunk.pop("prompt_token_ids", None)
        for choice in chunk.get("choices") or []:
            if not continuation and choice.get("prompt_token_ids") is not None:
                self.prompt_ids = list(choice["prompt_token_ids"])
            self.generated.extend(choice.get("token_ids") or [])
            if choice.get("finish_reason") is not None:
                self.finished = True
            text = choice.get("text")
            if isinstance(text, str):
                self.text_chars += len(text)
            delta = choice.get("delta") or {}
            if any(delta.get(k) for k in ("reasoning_content", "reasoning", "tool_calls")):
                self.content_only = False
            if not self.client_wants_ids:
                choice.pop("prompt_token_ids", None)
                choice.pop("token_ids", None)

    def _as_chat(self, chunk: dict[str, Any]) -> dict[str, Any]:
        choices = [{"index": c.get("index", 0), "delta": {"content": c.get("text", "")},
                    "logprobs": None, "finish_reason": c.get("finish_reason"),
                    **({"token_ids": c["token_ids"]} if "token_ids" in c else {})}
                   for c in chunk.get("choices") or []]
        out: dict[str, Any] = {"object": "chat.completion.chunk", "choices": choices}
        if "usage" in chunk:
            out["usage"] = chunk["usage"]
        return out

    def continuation(self, max_model_len: int | None) -> dict[str, Any] | str:
        """The completions request that continues the stream, or why there is none."""
        if self.finished:
            return "it had finished"
        if self.prompt_ids is None:
            return "decode sent no token ids"
        if self.chat and not self.content_only:
            return "reasoning or tool-call deltas"
        prompt = [*self.prompt_ids, *self.generated]
        if self.chat:
            limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
            request = {k: self.body[k] for k in CHAT_SAMPLING_FIELDS if k in self.body}
        else:
            limit = self.body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
            request = {k: v for k, v in self.body.items() if k not in COMPLETIONS_REPLACED}
        if limit is None:  # until the context ends, as the first instance would have gone
            if max_model_len is None:
                return "the instance's max_model_len is unknown"
            remaining = max_model_len - len(prompt)
        else:
            remaining = int(limit) - len(self.generated)
        if remaining < 1:
            return "no token was due"
        request.update(prompt=prompt, max_tokens=remaining, stream=True, return_token_ids=True)
        if min_tokens := self.body.get("min_tokens"):
            request["min_tokens"] = max(0, int(min_tokens) - len(self.generated))
        return request

