"""The proxy's listener: aiohttp's server behind a connection limit, with an idle timeout that
also bounds how long a client may take to send its request headers, and the process's open-file
limit raised so that the limit can be reached at all."""

from __future__ import annotations

import asyncio
import logging
import resource
import socket

from aiohttp import web

log = logging.getLogger("kvhelper.proxy")
_REFUSAL_BODY = (b'{"error": {"message": "the proxy is at its connection limit; retry later", '
                 b'"type": "overloaded", "code": 503}}')
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
           b"Connection: close\r\nContent-Length: " + str(len(_REFUSAL_BODY)).encode()
           + b"\r\n\r\n" + _REFUSAL_BODY)
# Open files besides client connections: upstream connections, etcd, logs, the event loop.
SPARE_FILES = 256


class _Refuse(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(REFUSAL)
        transport.close()


class ConnectionLimit:
    """A protocol factory for loop.create_server: aiohttp's own server while it holds fewer
    than `limit` connections, a one-line 503 after that."""

    def __init__(self, server: web.Server, limit: int) -> None:
        self.server, self.limit, self.refused = server, limit, 0

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.limit:
            self.refused += 1
            return _Refuse()
        return self.server()


def raise_open_file_limit(wanted: int) -> int:
    """Raise the soft open-file limit toward `wanted` (up to the hard limit); the result."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = target
    return soft


async def serve(app: web.Application, host: str, port: int, idle_timeout: float,
                max_connections: int) -> tuple[web.AppRunner, asyncio.AbstractServer]:
    """Start serving `app`; stop with `server.close()` and `runner.cleanup()`."""
    files = raise_open_file_limit(max_connections * 2 + SPARE_FILES)
    if files < max_connections * 2 + SPARE_FILES:
        log.warning("the open-file limit is %d: fewer than the %d that --max-connections %d "
                    "may need", files, max_connections * 2 + SPARE_FILES, max_connections)
    # aiohttp's keep-alive timer starts when a connection opens and is not reset by a request
    # that has not fully arrived: it closes idle connections and half-sent requests alike.
    runner = web.AppRunner(app, handler_cancellation=True, keepalive_timeout=idle_timeout,
                           access_log=None)
    await runner.setup()
    assert runner.server is not None
    loop = asyncio.get_running_loop()
    listener = await loop.create_server(ConnectionLimit(runner.server, max_connections), host,
                                        port, reuse_address=True, backlog=1024,
                                        family=socket.AF_INET if ":" not in host
                                        else socket.AF_INET6)
    return runner, listener
