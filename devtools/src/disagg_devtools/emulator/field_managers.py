"""Server-side apply by field manager, as the API server does it, for the emulator: each manager
owns the fields it last applied (or changed by an update), recorded in `metadata.managedFields`
(FieldsV1). An apply sets the fields it names, removes the fields its manager applied before and
no longer names unless another manager owns them too, and refuses (409) to change a field another
manager owns unless forced, which moves the field to it. An update (merge, JSON or strategic
patch, replace, /scale) takes the fields it changes from every other manager.

Simplifications, each stricter or equal for what the operator relies on: lists are atomic (the
API server merges some by key), and of metadata only labels, annotations and ownerReferences are
tracked."""

from __future__ import annotations

import copy
from typing import Any

Path = tuple[str, ...]
_METADATA_TRACKED = ("labels", "annotations", "ownerReferences")
_MISSING = object()


class ApplyConflict(Exception):
    """Fields another manager owns, with another value, applied without force."""

    def __init__(self, conflicts: list[tuple[Path, str]], api_version: str) -> None:
        self.conflicts = conflicts
        listed = "\n".join(f'- conflict with "{manager}" using {api_version}: '
                           f".{'.'.join(path)}" for path, manager in conflicts)
        super().__init__(f"Apply failed with {len(conflicts)} conflict"
                         f"{'s' if len(conflicts) > 1 else ''}: {listed}")


def _leaves(value: Any, prefix: Path) -> set[Path]:
    if isinstance(value, dict) and value:
        return {path for key, sub in value.items() for path in _leaves(sub, (*prefix, key))}
    return {prefix}


def managed_paths(obj: dict[str, Any]) -> set[Path]:
    """The fields of `obj` a manager can own: every leaf of the body but the status and the
    object's identity, and the tracked parts of its metadata."""
    paths: set[Path] = set()
    for key, value in obj.items():
        if key in ("apiVersion", "kind", "status"):
            continue
        if key == "metadata":
            for name in _METADATA_TRACKED:
                if name in (value or {}):
                    paths |= _leaves(value[name], ("metadata", name))
            continue
        paths |= _leaves(value, (key,))
    return paths


def _get(obj: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return _MISSING
        obj = obj[key]
    return obj


def _set(obj: dict[str, Any], path: Path, value: Any) -> None:
    for key in path[:-1]:
        if not isinstance(obj.get(key), dict):
            obj[key] = {}
        obj = obj[key]
    obj[path[-1]] = copy.deepcopy(value)


def _delete(obj: dict[str, Any], path: Path) -> None:
    """Remove a field, and the maps it leaves empty."""
    parents = [obj]
    for key in path[:-1]:
        child = parents[-1].get(key)
        if not isinstance(child, dict):
            return
        parents.append(child)
    parents[-1].pop(path[-1], None)
    for depth in range(len(path) - 2, -1, -1):
        if parents[depth + 1] == {}:
            parents[depth].pop(path[depth], None)


def to_fields_v1(paths: set[Path]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path in sorted(paths):
        node = tree
        for key in path:
            node = node.setdefault(f"f:{key}", {})
    return tree


def from_fields_v1(fields: dict[str, Any], prefix: Path = ()) -> set[Path]:
    paths: set[Path] = set()
    for key, sub in fields.items():
        if key == ".":
            continue
        path = (*prefix, key.removeprefix("f:"))
        paths |= from_fields_v1(sub, path) if sub else {path}
    return paths


def _owners(obj: dict[str, Any]) -> dict[str, tuple[str, set[Path]]]:
    """Manager -> (its last operation, its fields)."""
    return {entry["manager"]: (entry.get("operation", "Update"),
                               from_fields_v1(entry.get("fieldsV1") or {}))
            for entry in (obj.get("metadata") or {}).get("managedFields") or []}


def _record(obj: dict[str, Any], owners: dict[str, tuple[str, set[Path]]], at: str) -> None:
    entries = [{"manager": manager, "operation": operation,
                "apiVersion": obj.get("apiVersion", ""), "time": at,
                "fieldsType": "FieldsV1", "fieldsV1": to_fields_v1(paths)}
               for manager, (operation, paths) in sorted(owners.items()) if paths]
    obj.setdefault("metadata", {})["managedFields"] = entries


def created(obj: dict[str, Any], manager: str, operation: str, at: str) -> dict[str, Any]:
    """A new object: its creator owns everything in it."""
    after = copy.deepcopy(obj)
    _record(after, {manager: (operation, managed_paths(after))}, at)
    return after


def apply(current: dict[str, Any], body: dict[str, Any], manager: str, force: bool,
          at: str) -> dict[str, Any]:
    """`current` after `manager` applies `body` (the identity and status of `current` stay)."""
    owners = _owners(current)
    applied = managed_paths(body)
    conflicts = sorted((path, other) for other, (_, paths) in owners.items() if other != manager
                       for path in applied & paths if _get(current, path) != _get(body, path))
    if conflicts and not force:
        raise ApplyConflict(conflicts, str(body.get("apiVersion") or ""))
    taken = {path for path, _ in conflicts}
    owners = {other: (operation, paths - taken if other != manager else paths)
              for other, (operation, paths) in owners.items()}
    after = copy.deepcopy(current)
    before = owners.get(manager, ("Apply", set()))[1]
    others = set().union(*(paths for other, (_, paths) in owners.items() if other != manager))
    for path in before - applied - others:
        _delete(after, path)
    for path in applied:
        _set(after, path, _get(body, path))
    owners[manager] = ("Apply", applied)
    _record(after, owners, at)
    return after


def updated(current: dict[str, Any], after: dict[str, Any], manager: str,
            at: str) -> dict[str, Any]:
    """`after`, written by an update of `manager`, with the fields it changed moved to it."""
    owners = _owners(current)
    now = managed_paths(after)
    changed = {path for path in now | managed_paths(current)
               if _get(current, path) != _get(after, path)}
    owners = {other: (operation, (paths - changed) & now)
              for other, (operation, paths) in owners.items()}
    operation, mine = owners.get(manager, ("Update", set()))
    owners[manager] = (operation, mine | (changed & now))
    result = copy.deepcopy(after)
    _record(result, owners, at)
    return result
