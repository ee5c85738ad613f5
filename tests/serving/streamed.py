"""A streamed greedy completion through the proxy, as the load tests send it: the status, the
generated and prompt token ids, or what went wrong (a transport failure reads as status 599)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

TIMEOUT = aiohttp.ClientTimeout(total=120)


@dataclass
class Completion:
    text: str
    status: int = 200
    ids: list[int] = field(default_factory=list)
    prompt_ids: list[int] | None = None
    error: str = ""
    started: float = field(default_factory=time.monotonic)


async def complete(session: aiohttp.ClientSession, url: str, model: str, text: str,
                   max_tokens: int = 8) -> Completion:
    result = Completion(text)
    body = {"model": model, "prompt": text, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "return_token_ids": True}
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=TIMEOUT) as response:
            if response.status != 200:
                result.status, result.error = response.status, await response.text()
                return result
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line.removeprefix("data:"))
                if "error" in event:
                    result.status, result.error = 500, str(event["error"])
                    return result
                result.prompt_ids = event.get("prompt_token_ids") or result.prompt_ids
                for choice in event.get("choices", []):
                    result.ids += choice.get("token_ids") or []
                    result.prompt_ids = choice.get("prompt_token_ids") or result.prompt_ids
    except (aiohttp.ClientError, TimeoutError) as err:
        result.status, result.error = 599, f"{type(err).__name__}: {err}"
    return result
