"""What one vLLM instance announces about itself in etcd, and where.

Key: `<prefix><role>/<instance id>`; value: JSON of `Instance`. The prefix is namespaced per
DisaggServing (`/disagg/<namespace>/<name>/instances/`), so deployments sharing an etcd never
see each other's instances.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = ("prefill", "decode")


@dataclass(frozen=True)
class Instance:
    id: str
    role: Role
    url: str  # the OpenAI server's base URL, e.g. http://10.0.0.7:8000
    model: str
    fingerprint: str = ""  # KV compatibility; the proxy pairs only equal fingerprints
    # Written just before the registration is deleted on purpose (drain, SIGTERM, unhealthy),
    # so that readers tell a withdrawal from a lease that expired (kvhelper.discovery).
    withdrawing: bool = False

    def key(self, prefix: str) -> str:
        return f"{prefix}{self.role}/{self.id}"

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes | str) -> Instance:
        data = json.loads(raw)
        if data.get("role") not in ROLES:
            raise ValueError(f"unknown role {data.get('role')!r}")
        return cls(id=str(data["id"]), role=data["role"], url=str(data["url"]).rstrip("/"),
                   model=str(data.get("model", "")),
                   fingerprint=str(data.get("fingerprint", "")),
                   withdrawing=bool(data.get("withdrawing", False)))


def split_endpoints(value: str) -> list[tuple[str, int]]:
    """`host:port,host:port` (optionally with http://) into (host, port) pairs."""
    pairs = []
    for item in filter(None, (v.strip() for v in value.split(","))):
        address = item.split("://", 1)[-1].rstrip("/")
        host, _, port = address.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"etcd endpoint {item!r} is not host:port")
        pairs.append((host.strip("[]"), int(port)))
    if not pairs:
        raise ValueError("no etcd endpoint given")
    return pairs
