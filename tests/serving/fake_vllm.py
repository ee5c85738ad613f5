"""A test double of vLLM's OpenAI server (named as such): the HTTP behaviour the proxy relies on,
including `kv_transfer_params` and SSE streaming, with switches for failures. The real vLLM is
used by the connector and end-to-end tests."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from disagg_devtools.processes import free_port
from disagg_devtools.stand_in_model import next_token, prompt_ids, token_text


@dataclass
class FakeVLLM:
    name: str
    port: int = field(default_factory=free_port)
    tokens: int = 4  # streamed chunks per decode
    token_delay: float = 0.0
    prefill_delay: float = 0.0
    fail_status: int | None = None  # answer every completion with this error status
    die_after_tokens: int | None = None  # drop the connection mid-stream
    healthy: bool = True
    health_delay: float = 0.0  # a busy server: its health check answers this late
    frozen: bool = False  # accept connections but never answer, as a stopped process
    # Close a kept-alive connection as the next request arrives on it, unanswered: the race a
    # server's keep-alive timeout has with a client that picks the idle connection just then.
    drop_reused: bool = False
    api_key: str | None = None  # as vLLM's --api-key: completions need it
    # What prefill answers in kv_transfer_params (None: parameters of a peer-to-peer connector).
    prefill_params: dict[str, Any] | None = None
    requests: list[dict[str, Any]] = field(default_factory=list)
    headers: list[Any] = field(default_factory=list)  # case-insensitive mappings
    streamed_ids: list[list[int]] = field(default_factory=list)  # return_token_ids streams
    connections: list[Any] = field(default_factory=list)  # per answered request: client address
    dropped: int = 0
    aborted: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> FakeVLLM:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        self._runner = web.AppRunner(app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _drop_if_reused(self, request: web.Request) -> bool:
        """Close the connection unanswered when `drop_reused` and it served a request before;
        else remember it."""
        assert request.transport is not None
        connection = request.transport.get_extra_info("peername")
        if self.drop_reused and connection in self.connections:
            request.transport.close()
            self.dropped += 1
            return True
        self.connections.append(connection)
        return False

    async def _health(self, request: web.Request) -> web.Response:
        if self._drop_if_reused(request):
            return web.Response()
        await self._hang_while_frozen()
        await asyncio.sleep(self.health_delay)
        return web.Response(status=200 if self.healthy else 503)

    async def _hang_while_frozen(self) -> None:
        while self.frozen:
            await asyncio.sleep(0.05)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if self.api_key and request.headers.get("Authorization") != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        if self._drop_if_reused(request):
            return web.Response()
        body = await request.json()
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        await self._hang_while_frozen()
        if self.fail_status is not None:
            return web.json_response({"error": {"message": f"{self.name} refuses",
                                                "type": "BadRequestError",
                                                "code": self.fail_status}},
                                     status=self.fail_status)
        params = body.get("kv_transfer_params") or {}
        if params.get("do_remote_decode"):  # prefill: keep KV, tell decode where it is
            try:
                await asyncio.sleep(self.prefill_delay)
            except asyncio.CancelledError:
                self.aborted.set()
                raise
            return web.json_response({
                "id": "cmpl-p", "object": "text_completion",
                "choices": [{"index": 0, "text": "x", "finish_reason": "length"}],
                "kv_transfer_params": self.prefill_params or {
                    "do_remote_prefill": True, "remote_engine_id": self.name,
                    "remote_block_ids": [1, 2, 3], "remote_host": "h", "remote_port": 1}})
        loaded = "loaded" if params.get("do_remote_prefill") else "recomputed"
        if not body.get("stream"):
            await asyncio.sleep(self.tokens * self.token_delay)  # the whole answer at once
            if self.die_after_tokens is not None:
                assert request.transport is not None
                request.transport.close()
                return web.Response()
            return web.json_response({
                "id": "cmpl-d", "object": "text_completion",
                "choices": [{"index": 0, "text": f"{self.name} {loaded}",
                             "finish_reason": "length"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        if body.get("return_token_ids"):
            return await self._stream_tokens(request, response, body)
        try:
            for i in range(self.tokens):
                if self.die_after_tokens is not None and i == self.die_after_tokens:
                    assert request.transport is not None
                    request.transport.close()  # the instance dies mid-stream
                    return response
                chunk = {"choices": [{"index": 0, "text": f"t{i} "}]}
                await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(self.token_delay)
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()  # what vLLM does on a client disconnect: abort the request
            raise
        return response

    async def _stream_tokens(self, request: web.Request, response: web.StreamResponse,
                             body: dict[str, Any]) -> web.StreamResponse:
        """`return_token_ids`: the deterministic stand-in model (disagg_devtools.stand_in_model),
        so a stream continued from prompt plus generated ids on another instance gives what
        this one would have given."""
        try:
            return await self._write_tokens(request, response, body)
        except (asyncio.CancelledError, ConnectionResetError):
            self.aborted.set()
            raise

    async def _write_tokens(self, request: web.Request, response: web.StreamResponse,
                            body: dict[str, Any]) -> web.StreamResponse:
        chat = request.path.endswith("/chat/completions")
        prompt = prompt_ids(body)
        count = int(body.get("max_completion_tokens") or body.get("max_tokens") or self.tokens)
        ids = list(prompt)
        self.streamed_ids.append(ids)
        for i in range(count):
            if self.die_after_tokens is not None and i == self.die_after_tokens:
                assert request.transport is not None
                request.transport.close()
                return response
            token = next_token(ids)
            ids.append(token)
            finish = "length" if i == count - 1 else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": [token]}
            if chat:
                choice["delta"] = {"content": token_text(token), **({"role": "assistant"} if i == 0
                                                               else {})}
                chunk = {"id": f"chatcmpl-{self.name}", "object": "chat.completion.chunk",
                         "created": 1, "model": "tiny", "choices": [choice],
                         **({"prompt_token_ids": prompt} if i == 0 else {})}
            else:
                choice["text"] = token_text(token)
                if i == 0:
                    choice["prompt_token_ids"] = prompt
                chunk = {"id": f"cmpl-{self.name}", "object": "text_completion", "created": 1,
                         "model": "tiny", "choices": [choice]}
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
            await asyncio.sleep(self.token_delay)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

