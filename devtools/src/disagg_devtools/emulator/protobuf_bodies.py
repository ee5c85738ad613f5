"""Request bodies kubectl sends as Kubernetes protobuf (`application/vnd.kubernetes.protobuf`:
`kubectl create namespace`, `kubectl create configmap`), decoded to the JSON objects they stand
for. Only the kinds and fields listed here: any other body is refused (415), as an API server
refuses what it cannot decode.

The envelope: the magic `k8s\\0`, then a runtime.Unknown message (1: typeMeta {1: apiVersion,
2: kind}, 2: raw, the object's own message)."""

from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"
Fields = dict[int, tuple[str, str]]  # field number -> (JSON name, how to read it)

_OBJECT_META: Fields = {1: ("name", "str"), 2: ("generateName", "str"),
                        3: ("namespace", "str"), 11: ("labels", "map"),
                        12: ("annotations", "map"), 14: ("finalizers", "strs")}
_KINDS: dict[str, Fields] = {
    "Namespace": {1: ("metadata", "meta"), 2: ("spec", "namespace_spec")},
    "ConfigMap": {1: ("metadata", "meta"), 2: ("data", "map"), 3: ("binaryData", "map_bytes"),
                  4: ("immutable", "bool")},
}
_NESTED: dict[str, Fields] = {"meta": _OBJECT_META,
                              "namespace_spec": {1: ("finalizers", "strs")}}


class Undecodable(ValueError):
    """Not a body this emulator can read."""


def _varint(buf: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buf):
            raise Undecodable("truncated varint")
        byte = buf[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """Wire-format fields: (number, varint value or length-delimited bytes)."""
    found: list[tuple[int, int | bytes]] = []
    at = 0
    while at < len(buf):
        key, at = _varint(buf, at)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, at = _varint(buf, at)
            found.append((number, value))
        elif wire == 2:
            length, at = _varint(buf, at)
            found.append((number, buf[at:at + length]))
            at += length
        elif wire in (1, 5):
            at += 8 if wire == 1 else 4
        else:
            raise Undecodable(f"wire type {wire}")
    return found


def _message(buf: bytes, schema: Fields) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for number, value in _fields(buf):
        if number not in schema:
            continue
        name, how = schema[number]
        if how == "str" and isinstance(value, bytes):
            if value:  # an empty optional string is JSON's omitted field
                out[name] = value.decode()
        elif how == "bool" and isinstance(value, int):
            out[name] = bool(value)
        elif how == "strs" and isinstance(value, bytes):
            out.setdefault(name, []).append(value.decode())
        elif how in ("map", "map_bytes") and isinstance(value, bytes):
            entry = dict(_fields(value))
            key, item = entry.get(1, b""), entry.get(2, b"")
            assert isinstance(key, bytes) and isinstance(item, bytes)
            out.setdefault(name, {})[key.decode()] = (
                item.decode() if how == "map" else base64.b64encode(item).decode())
        elif how in _NESTED and isinstance(value, bytes):
            out[name] = _message(value, _NESTED[how])
    return out


def decode(body: bytes) -> dict[str, Any]:
    """The JSON object a Kubernetes protobuf request body holds."""
    if not body.startswith(MAGIC):
        raise Undecodable("no k8s protobuf envelope")
    envelope = dict(_fields(body[len(MAGIC):]))
    type_meta, raw = envelope.get(1, b""), envelope.get(2, b"")
    if not isinstance(type_meta, bytes) or not isinstance(raw, bytes):
        raise Undecodable("no object in the envelope")
    names = {n: v.decode() for n, v in _fields(type_meta) if isinstance(v, bytes)}
    api_version, kind = names.get(1, ""), names.get(2, "")
    if kind not in _KINDS:
        raise Undecodable(f"kind {kind or '?'}")
    return {"apiVersion": api_version, "kind": kind, **_message(raw, _KINDS[kind])}
