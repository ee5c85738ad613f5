"""Everything the API emulator needs from kmock 0.8 beyond its public API, in one place.

`server.py` uses only kmock's public names and the public ones defined here. Each item below
says which upstream change would remove it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp.web
import kmock
from kmock._internal import parsing, rendering
from typing_extensions import override

_parse_path = parsing.parse_path


def _parse_core_namespaces(path: str) -> parsing.ParsedPath:
    """`/api/v1/namespaces` and `/api/v1/namespaces/NAME` name the Namespace resource; kmock
    reads `namespaces` as the start of a namespaced path and fails on the bare list (a 500,
    so kopf's namespace-scoped mode never started). Upstream: parse_path should take
    `namespaces` followed by at most one segment as the plural."""
    parts = path.strip("/").split("/")
    if parts[:3] == ["api", "v1", "namespaces"] and len(parts) <= 4:
        return parsing.ParsedPath(group="", version="v1", plural="namespaces",
                                  name=parts[3] if len(parts) == 4 else None)
    return _parse_path(path)


parsing.parse_path = _parse_core_namespaces


def raw_request(request: kmock.Request) -> aiohttp.web.BaseRequest:
    """The aiohttp request under kmock's, to stream a response of our own. Upstream: a public
    `Request.raw` (kmock streams only its own watch format, octet-stream, which kubectl
    rejects)."""
    raw = request._raw_request
    assert raw is not None
    return raw


class KmockEmulator(kmock.KubernetesEmulator):
    """kmock's Kubernetes emulator with its private extension points behind public names, and
    the fixes to its discovery documents."""

    # The Kubernetes version whose API the emulator's behaviour follows (CEL in CRDs, SSA).
    SERVER_MINOR = "32"

    # -- request hook. Upstream: a public per-request hook (middleware) on the emulator. ----

    @override
    async def _handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        return await self.handle(request)

    async def handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Serve one request; override it and call `serve_default` for kmock's behaviour."""
        return await self.serve_default(request)

    async def serve_default(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        return await super()._handle(request)

    @property
    def request_history(self) -> list[kmock.Request]:
        """kmock's record of requests, which it matches each new request against (quadratic
        over a long run). Upstream: a bound on that history."""
        history: list[kmock.Request] = self._requests
        return history

    # -- state changes that kmock's own handlers did not make. Upstream: public methods to
    # -- emit a watch event and to take the store's lock.

    @property
    def write_lock(self) -> asyncio.Lock:
        lock: asyncio.Lock = self._lock
        return lock

    async def emit_watch_event(self, resource: kmock.resource, event: dict[str, Any]) -> None:
        await self._buses[resource].put(event)

    def watch_events(self, request: kmock.Request) -> AsyncIterator[Any]:
        """kmock's watch events for a request, for a stream of our own (see raw_request)."""
        events: AsyncIterator[Any] = self._serve_watch(request)
        return events

    # -- discovery fixes. --------------------------------------------------------------------

    def declared_resources(self) -> list[kmock.resource]:
        return self._get_resources()

    @override
    def _get_resources(self) -> list[kmock.resource]:
        # Every resource served is declared (bundled or by a CRD); kmock's own version also
        # scans every stored object on each discovery request. Upstream: an option to serve
        # declared resources only.
        return super(kmock.KubernetesEmulator, self)._get_resources()

    @override
    async def _serve_server_version(self, request: kmock.Request) -> dict[str, Any]:
        # Upstream: a configurable server version.
        version = await super()._serve_server_version(request)
        assert isinstance(version, dict)
        return {**version, "minor": self.SERVER_MINOR,
                "gitVersion": f"v1.{self.SERVER_MINOR}.0-emulated"}

    @override
    async def _serve_version(self, request: kmock.Request) -> rendering.Payload:
        # Upstream bugs: the core group is reported as "/v1", and subresources get their
        # parent's short names and categories (kubectl then finds two resources per name).
        payload = await super()._serve_version(request)
        if isinstance(payload, dict):
            if payload.get("groupVersion") == "/v1":
                payload["groupVersion"] = "v1"
            for entry in payload.get("resources", []):
                if "/" in entry["name"]:
                    entry["shortNames"], entry["categories"] = [], []
        return payload
