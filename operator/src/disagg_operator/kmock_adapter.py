"""Fixes to kmock 0.8's private internals that the API emulator needs, in one place. Each says
which upstream change would remove it; importing this module applies them."""

from __future__ import annotations

from kmock._internal import parsing

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
