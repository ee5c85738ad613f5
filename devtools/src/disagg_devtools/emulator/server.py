"""A Kubernetes API emulator for development and tests: kmock's KubernetesEmulator, completed.

This is a stand-in for a real API server (none can run on the CI machines), not a mock of our
own code. It adds what the operator and `kubectl` rely on and kmock leaves out: server-side
apply, uid/generation/resourceVersion, status-subresource semantics, label and field selectors,
ownerReference garbage collection, CRD registration on create, Table output for printer columns,
kubectl-readable discovery, lists and watches, and an optional workload controller that reports
Deployments and StatefulSets ready (there is no kubelet here).
"""

from __future__ import annotations

import asyncio
import copy
import datetime
import itertools
import json
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp.web
import attrs
import jsonpatch
import jsonpointer
import jsonschema
import kmock
from jsonpath_ng.ext import parse as jsonpath_parse  # type: ignore[attr-defined]
from typing_extensions import override

from disagg_devtools.emulator import field_managers, protobuf_bodies
from disagg_devtools.emulator.kmock_adapter import KmockEmulator, raw_request

APPLY_CONTENT_TYPE = "application/apply-patch+yaml"
NAMESPACES = kmock.resource("", "v1", "namespaces")
# Workloads whose controllers the emulator stands in for, by plural: their API group.
WORKLOAD_GROUPS = {"deployments": "apps", "statefulsets": "apps",
                   "leaderworkersets": "leaderworkerset.x-k8s.io"}
WORKLOAD_PLURALS = tuple(WORKLOAD_GROUPS)
STATEFULSET_MUTABLE = {"replicas", "ordinals", "template", "updateStrategy",
                       "persistentVolumeClaimRetentionPolicy", "minReadySeconds"}
# kmock matches every request against its whole request history (quadratic over a long run);
# it keeps only the requests in flight and this many recent ones. `request_log` keeps a cheap
# record of every request instead.
KMOCK_HISTORY = 0


@attrs.define
class RequestRecord:
    method: str
    path: str
    action: str | None
    plural: str | None
    dry_run: bool = False
    at: float = 0.0  # time.monotonic() when it arrived
    served: bool = False  # answered, not cancelled (e.g. by its client dying)

    @property
    def is_write(self) -> bool:
        return self.method in ("POST", "PUT", "PATCH", "DELETE")
Readiness = Literal["instant", "manual"]


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _manager(request: kmock.Request) -> str:
    """The request's field manager: its fieldManager parameter, else its client's name (the
    API server takes the user agent's first word)."""
    named = request.params.get("fieldManager")
    if named:
        return str(named)
    agent = request.headers.get("User-Agent", "") or "unknown"
    return agent.split("/", 1)[0] or "unknown"


def _age(timestamp: str) -> str:
    """A timestamp as the API server's Table shows it: the time since, e.g. 42s, 5m, 3h, 2d."""
    then = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    seconds = max(0, int((datetime.datetime.now(datetime.UTC) - then).total_seconds()))
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _merge_patch_to(current: dict[str, Any], target: dict[str, Any]) -> dict[str, Any]:
    """A JSON merge patch that turns `current` into `target` (None deletes a key)."""
    patch: dict[str, Any] = {}
    for key in current.keys() - target.keys():
        patch[key] = None
    for key, value in target.items():
        old = current.get(key)
        if isinstance(old, dict) and isinstance(value, dict):
            sub = _merge_patch_to(old, value)
            if sub:
                patch[key] = sub
        elif old != value or key not in current:
            patch[key] = value
    return patch


def _deep_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    result = dict(base)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = _deep_merge(result[key], value)
        else:
            result[key] = value
    return result


def _matches_labels(obj: dict[str, Any], selector: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key) == value:
                return False
        elif "=" in term:
            key, value = term.split("==", 1) if "==" in term else term.split("=", 1)
            if labels.get(key) != value:
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


def _matches_fields(obj: dict[str, Any], selector: str) -> bool:
    """A field selector: `path=value`, `path==value` or `path!=value` terms on dotted paths
    (metadata.name, involvedObject.name, type, ...), all of which must hold."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        negate = "!=" in term
        key, _, value = term.replace("!=", "=").replace("==", "=").partition("=")
        found: Any = obj
        for part in key.split("."):
            found = found.get(part) if isinstance(found, dict) else None
        actual = "" if found is None else str(found)
        if (actual == value) == negate:
            return False
    return True


@attrs.frozen
class ScalePaths:
    """Where a resource keeps what its Scale shows (a CRD's `subresources.scale`)."""

    spec_replicas: str = ".spec.replicas"
    status_replicas: str = ".status.replicas"
    label_selector: str | None = None  # None: the workload's spec.selector.matchLabels


WORKLOAD_SCALE = ScalePaths()


def _at(obj: dict[str, Any], path: str) -> Any:
    value: Any = obj
    for part in path.strip(".").split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def _merge_patch_at(path: str, value: Any) -> dict[str, Any]:
    patch: dict[str, Any] = {}
    node = patch
    *parents, leaf = path.strip(".").split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return patch


def _scale_of(obj: dict[str, Any], paths: ScalePaths = WORKLOAD_SCALE) -> dict[str, Any]:
    meta = obj.get("metadata") or {}
    if paths.label_selector is None:
        labels = ((obj.get("spec") or {}).get("selector") or {}).get("matchLabels") or {}
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
    else:
        selector = str(_at(obj, paths.label_selector) or "")
    replicas = _at(obj, paths.spec_replicas)
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion",
                                              "creationTimestamp") if k in meta},
            "spec": {"replicas": 1 if replicas is None else int(replicas)},  # as defaulted
            "status": {"replicas": int(_at(obj, paths.status_replicas) or 0),
                       "selector": selector}}


def _check_precondition(current: dict[str, Any] | None, data: dict[str, Any],
                        name: str | None) -> None:
    """A write that names a resourceVersion applies only to that version (optimistic
    concurrency: what leader election and every read-modify-write rely on)."""
    wanted = (data.get("metadata") or {}).get("resourceVersion")
    if current is None or not wanted:
        return
    if str(wanted) != str(current.get("metadata", {}).get("resourceVersion")):
        raise kmock.KubernetesError(
            status=409, reason="Conflict",
            message=f"Operation cannot be fulfilled on {name!r}: the object has been "
                    "modified; please apply your changes to the latest version and try again")


def _rewrite(request: kmock.Request, **changes: Any) -> kmock.Request:
    """Change a parsed request in place: kmock tracks requests by identity, so no copies."""
    for name, value in changes.items():
        object.__setattr__(request, name, value)
    return request


def apply_schema_defaults(schema: dict[str, Any], value: Any) -> Any:
    """Structural-schema defaulting: fill absent properties that declare a default."""
    if isinstance(value, dict) and "properties" in schema:
        result = dict(value)
        for name, sub in schema["properties"].items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
            if name in result:
                result[name] = apply_schema_defaults(sub, result[name])
        return result
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [apply_schema_defaults(schema["items"], item) for item in value]
    return value


def unknown_fields(schema: dict[str, Any], value: Any, path: str = "") -> list[str]:
    """Fields of `value` its structural schema does not declare (the API server prunes them,
    or refuses them under fieldValidation=Strict), as dotted paths."""
    if schema.get("x-kubernetes-preserve-unknown-fields"):
        return []
    found: list[str] = []
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in value.items():
            where = f"{path}.{name}" if path else name
            if name not in schema["properties"]:
                if not schema.get("additionalProperties"):
                    found.append(where)
            else:
                found += unknown_fields(schema["properties"][name], sub, where)
    elif isinstance(value, dict) and isinstance(schema.get("additionalProperties"), dict):
        for name, sub in value.items():
            found += unknown_fields(schema["additionalProperties"], sub,
                                    f"{path}.{name}" if path else name)
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for index, item in enumerate(value):
            found += unknown_fields(schema["items"], item, f"{path}[{index}]")
    return found


def _prune(value: Any, path: str) -> None:
    """Remove the field at a dotted path (as unknown_fields names it)."""
    parts = re.findall(r"[^.\[\]]+|\[\d+\]", path)
    for part in parts[:-1]:
        value = value[int(part[1:-1])] if part.startswith("[") else value[part]
    value.pop(parts[-1], None)


def plain_schema(schema: Any) -> Any:
    """The schema without Kubernetes extensions that JSON Schema would misread."""
    if isinstance(schema, dict):
        plain = {k: plain_schema(v) for k, v in schema.items() if not k.startswith("x-")}
        if schema.get("x-kubernetes-int-or-string"):
            plain["type"] = ["integer", "string"]
        return plain
    if isinstance(schema, list):
        return [plain_schema(v) for v in schema]
    return schema


@attrs.define(kw_only=True)
class ClusterEmulator(KmockEmulator):
    """The emulated API server. `readiness` decides how workloads report ready replicas."""

    readiness: Readiness = "instant"
    printer_columns: dict[kmock.resource, list[dict[str, Any]]] = attrs.field(factory=dict)
    schemas: dict[kmock.resource, dict[str, Any]] = attrs.field(factory=dict)
    scale_paths: dict[kmock.resource, ScalePaths] = attrs.field(factory=dict)
    # Seconds a write to these resources (by plural) waits before it is served.
    write_delays: dict[str, float] = attrs.field(factory=dict)
    request_log: list[RequestRecord] = attrs.field(factory=list, init=False)
    _in_flight: set[int] = attrs.field(factory=set, init=False)
    _index: dict[Any, list[Any]] = attrs.field(factory=dict, init=False)
    _indexed_count: int = attrs.field(default=-1, init=False)
    _versions: Any = attrs.field(factory=lambda: itertools.count(1), init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.resources.load_bundled()
        for namespace in ("default", "kube-system"):
            self.ensure_namespace(namespace)
        self.fallback["get /openapi/v3"] << (lambda: self.openapi_v3_root())
        self.fallback["get", re.compile(r"/openapi/v3/apis?/.+")] << (
            lambda request: self.openapi_v3_group(
                request.url.path.split("/openapi/v3/", 1)[1].removeprefix("api/")
                .removeprefix("apis/")))

    # -- resources --------------------------------------------------------------------------

    def register_crd(self, crd: dict[str, Any]) -> None:
        """Serve a CustomResourceDefinition's resource, as an API server does on CRD creation."""
        spec = crd["spec"]
        for version in spec["versions"]:
            res = kmock.resource(spec["group"], version["name"], spec["names"]["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=spec["names"]["kind"], singular=spec["names"].get("singular"),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced",
                verbs={"get", "list", "watch", "create", "update", "patch", "delete"},
                shortnames=set(spec["names"].get("shortNames", [])),
                categories=set(spec["names"].get("categories", [])),
                subresources=set(version.get("subresources", {})),
            )
            schema = version.get("schema", {}).get("openAPIV3Schema")
            if schema:
                self.schemas[res] = schema
            if version.get("additionalPrinterColumns"):
                self.printer_columns[res] = version["additionalPrinterColumns"]
            scale = version.get("subresources", {}).get("scale")
            if scale:
                self.scale_paths[res] = ScalePaths(
                    scale["specReplicasPath"], scale["statusReplicasPath"],
                    scale.get("labelSelectorPath"))

    def _info(self, res: kmock.resource) -> kmock.ResourceInfo | None:
        info = self.resources.get(res) if res in self.resources else None
        return info if isinstance(info, kmock.ResourceInfo) else None

    def _has_status_subresource(self, res: kmock.resource) -> bool:
        info = self._info(res)
        return bool(info and "status" in info.subresources)

    def _stored(self, key: Any) -> dict[str, Any] | None:
        if key in self.objects and not self.objects[key].deleted:
            return dict(self.objects[key].raw)
        return None

    # -- request handling -------------------------------------------------------------------

    @override
    async def handle(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        record = RequestRecord(
            request.method.value if request.method else "", request.url.path,
            request.action.value if request.action else None,
            request.resource.plural if request.resource else None,
            request.params.get("dryRun") == "All", time.monotonic())
        self.request_log.append(record)
        self._in_flight.add(id(request))
        self._trim_history()
        plural = request.resource.plural if request.resource else None
        delay = self.write_delays.get(plural or "", 0.0)
        if delay and request.method not in (kmock.method.GET, None):
            await asyncio.sleep(delay)  # a slow API server: tests can act mid-reconcile
        try:
            response = await self._route(request)
            record.served = True
            return response
        finally:
            self._in_flight.discard(id(request))

    def _trim_history(self) -> None:
        if len(self.request_history) <= 4 * KMOCK_HISTORY + 16:
            return
        keep_from = len(self.request_history) - KMOCK_HISTORY
        self.request_history[:] = [r for index, r in enumerate(self.request_history)
                             if index >= keep_from or id(r) in self._in_flight]

    async def _route(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        if request.resource is None:
            return await self.serve_default(request)
        if "protobuf" in request.headers.get("Content-Type", ""):
            try:
                _rewrite(request, data=protobuf_bodies.decode(request.body or b""))
            except protobuf_bodies.Undecodable as err:
                raise kmock.KubernetesError(
                    status=415, reason="UnsupportedMediaType",
                    message=f"the body of the request was in an unknown format ({err}) - "
                            "accepted media types include: application/json, "
                            "application/yaml, application/apply-patch+yaml, "
                            "application/merge-patch+json") from None
        if request.method == kmock.method.PUT and request.name and request.action is None:
            _rewrite(request, action=kmock.action.UPDATE)  # a replace; kmock names none
        if request.subresource == "scale" and (request.resource.plural in WORKLOAD_PLURALS
                                               or request.resource in self.scale_paths):
            return await self._serve_scale(request)
        if request.action == kmock.action.WATCH:
            return await self._stream_watch(request)
        if request.action in (kmock.action.LIST, kmock.action.FETCH) and self._wants_table(
                request) and request.resource in self.printer_columns:
            return await self._serve_table(request)
        if request.action == kmock.action.LIST:
            return await self._serve_filtered_list(request)
        is_write = request.action in (kmock.action.CREATE, kmock.action.UPDATE,
                                      kmock.action.DELETE)
        if is_write and request.params.get("dryRun") == "All":
            # Validate and admit as for real, store nothing.
            prepared = self._prepare_write(request)
            return aiohttp.web.json_response(prepared.data if isinstance(
                prepared.data, dict) else self._stored(
                    (request.resource, request.namespace, request.name)) or {})
        request = self._prepare_write(request)
        response = await self.serve_default(request)
        if request.action in (kmock.action.CREATE, kmock.action.UPDATE):
            await self._after_write(request)
        if request.action in (kmock.action.DELETE, kmock.action.UPDATE):
            # A delete, or a patch that removed the last finalizer, may orphan children.
            await self._collect_garbage()
        assert request.resource is not None
        if request.action == kmock.action.CREATE and request.resource.plural == \
                "customresourcedefinitions" and request.data:
            self.register_crd(request.data)
            # As the API server does once the new resource is served.
            key = (request.resource, None, request.data["metadata"]["name"])
            await self._publish(key, {"status": {"conditions": [
                {"type": t, "status": "True", "reason": r, "lastTransitionTime": _now(),
                 "message": m} for t, r, m in (
                    ("NamesAccepted", "NoConflicts", "no conflicts found"),
                    ("Established", "InitialNamesAccepted",
                     "the initial names have been accepted"))]}})
        return response

    def _prepare_write(self, request: kmock.Request) -> kmock.Request:
        res = request.resource
        assert res is not None
        if request.method == kmock.method.PATCH and isinstance(request.data, list):
            # A JSON patch (kubectl patch --type=json, kopf's finalizers): applied here, so
            # that it is validated and bumps the generation like any other write.
            current = self._stored((res, request.namespace, request.name))
            if current is None:
                return request
            try:
                patched = jsonpatch.apply_patch(current, request.data, in_place=False)
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as err:
                # What the API server answers, e.g. for a failed "test" operation.
                raise kmock.KubernetesError(
                    status=422, reason="Invalid",
                    message=f"the server rejected our request due to an error in our "
                            f"request: {err}") from None
            if request.subresource == "status":
                after = {**current, "status": patched.get("status")}
            else:
                after = {**patched, **({"status": current["status"]} if "status" in current
                                       and self._has_status_subresource(res) else {})}
                after = field_managers.updated(current, after, _manager(request), _now())
            return self._admit_change(request, res, current, after)
        data = request.data if isinstance(request.data, dict) else None
        is_apply = request.headers.get("Content-Type", "").startswith(APPLY_CONTENT_TYPE)
        if request.method in (kmock.method.PATCH, kmock.method.PUT) and data is not None:
            key = (res, request.namespace, request.name)
            current = self._stored(key)
            _check_precondition(current, data, request.name)
        if request.method == kmock.method.PUT and data is not None:
            # A replace: the body is the whole object; the server's own metadata stays.
            if current is None:
                raise kmock.KubernetesError(status=404, reason="NotFound",
                                            message=f"{request.name!r} not found")
            after = copy.deepcopy(data)
            after["metadata"] = {**data.get("metadata", {}), **{
                k: v for k, v in current.get("metadata", {}).items()
                if k in ("uid", "creationTimestamp", "generation", "namespace", "name")}}
            if "status" in current and self._has_status_subresource(res):
                after["status"] = current["status"]
            after = field_managers.updated(current, after, _manager(request), _now())
            _rewrite(request, method=kmock.method.PATCH)
            return self._admit_change(request, res, current, after)
        if request.method == kmock.method.PATCH and data is not None:
            if is_apply and current is None:
                return self._as_create(request, data, operation="Apply")
            if current is None:
                return request
            if request.subresource == "status" and is_apply:
                after = {**current, "status": data.get("status")}
            elif request.subresource == "status":
                # A merge patch of the status: merged into it, a null removing a key.
                after = {**current, "status": _deep_merge(current.get("status") or {},
                                                          data.get("status") or {})}
            elif is_apply:
                # Merged by field manager: see field_managers.
                force = str(request.params.get("force", "")).lower() == "true"
                try:
                    after = field_managers.apply(current, data, _manager(request), force,
                                                 _now())
                except field_managers.ApplyConflict as err:
                    raise kmock.KubernetesError(status=409, reason="Conflict",
                                                message=str(err)) from None
            else:
                patch = dict(data)
                if self._has_status_subresource(res):
                    patch.pop("status", None)
                after = field_managers.updated(current, _deep_merge(current, patch),
                                               _manager(request), _now())
            return self._admit_change(request, res, current, after)
        if request.action == kmock.action.CREATE and data is not None:
            return self._as_create(request, data)
        return request

    def _admit_change(self, request: kmock.Request, res: kmock.resource,
                      current: dict[str, Any], after: dict[str, Any]) -> kmock.Request:
        """Validate `after` as the API server would and make the request write exactly it."""
        self._check_immutable(res, current, after)
        after = self._admit(res, after, request)
        after["metadata"]["resourceVersion"] = str(next(self._versions))
        if after.get("spec") != current.get("spec"):
            after["metadata"]["generation"] = int(current["metadata"].get("generation", 1)) + 1
        return _rewrite(request, data=_merge_patch_to(current, after))

    async def _serve_scale(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """The scale subresource of a Deployment, a StatefulSet or a custom resource that
        declares one (kubectl scale, an HPA): an autoscaling/v1 Scale; a write to it is a
        write of the object's replicas path."""
        assert request.resource is not None
        key = (request.resource, request.namespace, request.name)
        paths = self.scale_paths.get(request.resource, WORKLOAD_SCALE)
        current = self._stored(key)
        if current is None:
            return await self.serve_default(request)  # the API server's 404
        if request.method in (kmock.method.PATCH, kmock.method.PUT):
            scale = _scale_of(current, paths)
            data = request.data
            try:
                wanted = (jsonpatch.apply_patch(scale, data, in_place=False)
                          if isinstance(data, list) else _deep_merge(scale, dict(data or {})))
                replicas = int(wanted["spec"]["replicas"])
            except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException,
                    KeyError, TypeError, ValueError) as err:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid",
                    message=f"Scale.autoscaling {request.name!r} is invalid: {err}") from None
            _rewrite(request, subresource=None, method=kmock.method.PATCH,
                     data=_merge_patch_at(paths.spec_replicas, replicas))
            await self._route(request)
            current = self._stored(key) or current
        return aiohttp.web.json_response(_scale_of(current, paths))

    def _check_immutable(self, res: kmock.resource, current: dict[str, Any],
                         after: dict[str, Any]) -> None:
        """The update rules of the workload controllers' API validation."""
        if res.plural not in WORKLOAD_PLURALS:
            return
        kind, name = self._kind(res), current["metadata"].get("name")
        before, now = current.get("spec") or {}, after.get("spec") or {}
        if before.get("selector") != now.get("selector"):
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f'{kind}.apps "{name}" is invalid: spec.selector: Invalid value: '
                        f"{json.dumps(now.get('selector'))}: field is immutable")
        if res.plural == "statefulsets":
            changed = sorted(k for k in set(before) | set(now)
                             if k not in STATEFULSET_MUTABLE and before.get(k) != now.get(k))
            if changed:
                raise kmock.KubernetesError(
                    status=422, reason="Invalid",
                    message=f'{kind}.apps "{name}" is invalid: spec: Forbidden: updates to '
                            "statefulset spec for fields other than 'replicas', 'ordinals', "
                            "'template', 'updateStrategy', "
                            "'persistentVolumeClaimRetentionPolicy' and 'minReadySeconds' are "
                            f"forbidden (changed: {', '.join(changed)})")

    def ensure_namespace(self, name: str) -> None:
        """A Namespace object for `name`: the API server has one for every namespace in use
        (kopf lists them when it watches only some namespaces)."""
        key = (NAMESPACES, None, name)
        if self._stored(key) is None:
            self.objects[key] = {
                "apiVersion": "v1", "kind": "Namespace",
                "metadata": {"name": name, "uid": str(uuid.uuid4()),
                             "creationTimestamp": _now(),
                             "resourceVersion": str(next(self._versions))},
                "status": {"phase": "Active"}}

    def _as_create(self, request: kmock.Request, data: dict[str, Any],
                   operation: str = "Update") -> kmock.Request:
        assert request.resource is not None
        body = field_managers.created(data, _manager(request), operation, _now())
        meta = body.setdefault("metadata", {})
        if request.namespace and not meta.get("namespace"):
            meta["namespace"] = request.namespace  # kmock's namespaced watches need it
        if meta.get("namespace"):
            self.ensure_namespace(meta["namespace"])
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        meta.update(uid=str(uuid.uuid4()), generation=1, creationTimestamp=_now(),
                    resourceVersion=str(next(self._versions)))
        if self._has_status_subresource(request.resource):
            body.pop("status", None)
        body = self._admit(request.resource, body, request)
        return _rewrite(request, data=body, action=kmock.action.CREATE)

    def _admit(self, res: kmock.resource, obj: dict[str, Any],
                request: kmock.Request | None = None) -> dict[str, Any]:
        """Default and validate a custom resource against its CRD schema, as the API server does:
        fields the schema does not declare are pruned, or refused where the request asks for
        fieldValidation=Strict (kubectl's default).

        CEL rules (x-kubernetes-validations) are not evaluated here; the operator re-checks them.
        """
        schema = self.schemas.get(res)
        if schema is None:
            return obj
        defaulted = copy.deepcopy(apply_schema_defaults(schema, obj))
        unknown = unknown_fields(schema, {k: v for k, v in defaulted.items()
                                          if k not in ("apiVersion", "kind", "metadata")})
        strict = request is not None and request.params.get("fieldValidation") == "Strict"
        if unknown and strict:
            raise kmock.KubernetesError(
                status=400, reason="BadRequest", message="strict decoding error: " + ", ".join(
                    f'unknown field "{where}"' for where in unknown))
        for where in unknown:
            _prune(defaulted, where)
        errors = sorted(jsonschema.Draft4Validator(plain_schema(schema)).iter_errors(
            {k: v for k, v in defaulted.items() if k != "metadata"}), key=str)
        if errors:
            first = errors[0]
            where = ".".join(str(p) for p in first.absolute_path)
            raise kmock.KubernetesError(
                status=422, reason="Invalid",
                message=f'{self._kind(res)} "{obj.get("metadata", {}).get("name")}" is invalid: '
                        f"{where}: {first.message}")
        return dict(defaulted)

    async def _after_write(self, request: kmock.Request) -> None:
        res = request.resource
        assert res is not None
        if res.plural in WORKLOAD_PLURALS and self.readiness == "instant" \
                and request.subresource != "status":
            name = request.name or (request.data or {}).get("metadata", {}).get("name")
            namespace = request.namespace or (request.data or {}).get(
                "metadata", {}).get("namespace")
            await self.set_workload_ready(res.plural, namespace, name)

    async def _publish(self, key: Any, patch: dict[str, Any]) -> None:
        async with self.write_lock:
            self.objects[key].patch(patch)
            await self.emit_watch_event(key[0], {"type": "MODIFIED",
                                                 "object": self.objects[key].raw})

    async def set_workload_ready(self, plural: str, namespace: str | None, name: str,
                                 ready: int | None = None) -> None:
        """Report a Deployment/StatefulSet/LeaderWorkerSet rolled out with `ready` (default:
        all) replicas (for a LeaderWorkerSet: groups)."""
        res = kmock.resource(WORKLOAD_GROUPS[plural], "v1", plural)
        key = (res, namespace, name)
        obj = self._stored(key)
        if obj is None:
            return
        replicas = int(obj.get("spec", {}).get("replicas", 1))
        count = replicas if ready is None else ready
        status: dict[str, Any] = {
            "observedGeneration": obj["metadata"].get("generation", 1), "replicas": replicas,
            "updatedReplicas": replicas, "readyReplicas": count, "availableReplicas": count}
        # What rollout waiters (kubectl rollout status, helm --wait) look at as well.
        if plural == "deployments":
            status["conditions"] = [
                {"type": "Available", "status": "True" if count >= replicas else "False",
                 "reason": "MinimumReplicasAvailable"},
                {"type": "Progressing", "status": "True", "reason": "NewReplicaSetAvailable"}]
        elif plural == "leaderworkersets":
            # Its controller reports no observedGeneration, and groups rather than pods; its
            # conditions are metav1.Conditions, every field required by its CRD.
            del status["observedGeneration"], status["availableReplicas"]
            available = count >= replicas
            before = {c.get("type"): c for c in (obj.get("status") or {}).get("conditions") or []}
            kept = before.get("Available") or {}
            status["conditions"] = [{
                "type": "Available", "status": "True" if available else "False",
                "reason": "AllGroupsReady" if available else "GroupsNotReady",
                "message": f"{count} of {replicas} groups ready",
                "lastTransitionTime": (kept["lastTransitionTime"] if kept.get("status") ==
                                       ("True" if available else "False") else _now())}]
        else:
            revision = f"{obj['metadata']['name']}-{obj['metadata'].get('generation', 1)}"
            status.update(currentReplicas=replicas, currentRevision=revision,
                          updateRevision=revision)
        if (obj.get("status") or {}) != status:
            # What a real controller writes goes through the API server's validation too: a
            # stand-in that wrote what the CRD rejects would hide what a cluster does.
            self._admit(res, {**obj, "status": status})
            await self._publish(key, {"status": status})

    async def set_workload_status(self, plural: str, namespace: str, name: str,
                                  status: dict[str, Any]) -> None:
        key = (kmock.resource("apps", "v1", plural), namespace, name)
        if self._stored(key) is not None:
            await self._publish(key, {"status": status})

    async def _collect_garbage(self) -> None:
        """Delete objects whose owners are all gone (foreground-less, like the GC controller)."""
        while True:
            alive = {obj.raw.get("metadata", {}).get("uid") for obj in self.objects.values()
                     if not obj.deleted}
            orphans = [
                key for key, obj in self.objects.items() if not obj.deleted
                and (refs := obj.raw.get("metadata", {}).get("ownerReferences"))
                and all(ref.get("uid") not in alive for ref in refs)
            ]
            # A deleted namespace takes everything in it (the namespace controller).
            gone = self._deleted_namespaces()
            in_gone = [key for key, obj in self.objects.items() if not obj.deleted
                       and key[1] is not None and key[1] in gone and key not in orphans]
            finalizing = [key for key in in_gone
                          if self.objects[key].raw.get("metadata", {}).get("finalizers")]
            orphans += [key for key in in_gone if key not in finalizing]
            async with self.write_lock:
                for key in finalizing:  # their controllers remove the finalizers first
                    meta = self.objects[key].raw.get("metadata", {})
                    if not meta.get("deletionTimestamp"):
                        self.objects[key].patch({"metadata": {"deletionTimestamp": _now()}})
                        await self.emit_watch_event(key[0], {
                            "type": "MODIFIED", "object": self.objects[key].raw})
            if not orphans:
                return
            async with self.write_lock:
                for key in orphans:
                    raw = self.objects[key].raw
                    self.objects[key].delete()
                    await self.emit_watch_event(key[0], {"type": "DELETED", "object": raw})

    def _deleted_namespaces(self) -> set[str]:
        """Namespaces whose Namespace object was deleted, with no new one of the name."""
        gone: set[str] = set()
        live: set[str] = set()
        for (res, _, name), obj in self.objects.items():
            if res == NAMESPACES:
                (gone if obj.deleted else live).add(name)
        return gone - live

    # -- reading ----------------------------------------------------------------------------

    def _keys_of(self, res: kmock.resource) -> list[Any]:
        """Object keys of one resource. Keys are never removed (deletion is soft), so the index
        only needs a rebuild when their number changes."""
        if len(self.objects) != self._indexed_count:
            index: dict[Any, list[Any]] = {}
            for key in self.objects:
                index.setdefault(key[0], []).append(key)
            self._index, self._indexed_count = index, len(self.objects)
        return self._index.get(res, [])

    def _select(self, request: kmock.Request) -> list[dict[str, Any]]:
        labels = request.params.get("labelSelector", "")
        fields = request.params.get("fieldSelector", "")
        found = []
        assert request.resource is not None
        for key in self._keys_of(request.resource):
            _, namespace, name = key
            if request.namespace is not None and namespace != request.namespace:
                continue
            if request.name is not None and name != request.name:
                continue
            obj = self.objects[key]
            if obj.deleted:
                continue
            raw = dict(obj.raw)
            if _matches_labels(raw, labels) and _matches_fields(raw, fields):
                found.append(raw)
        return found

    def _kind(self, res: kmock.resource) -> str:
        info = self._info(res)
        return info.kind if info and info.kind else str(res.plural or "").capitalize()

    def _api_version(self, res: kmock.resource) -> str:
        return f"{res.group}/{res.version}" if res.group else str(res.version)

    async def _serve_filtered_list(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        assert res is not None
        if res not in self.declared_resources():
            return await self.serve_default(request)  # the 404 of an unknown resource
        items = [{"apiVersion": self._api_version(res), "kind": self._kind(res), **obj}
                 for obj in self._select(request)]
        return aiohttp.web.json_response({
            "apiVersion": self._api_version(res), "kind": f"{self._kind(res)}List",
            "metadata": {"resourceVersion": str(next(self._versions))}, "items": items})

    async def _stream_watch(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """kmock's watch, served as JSON lines (kubectl rejects octet-stream)."""
        labels = request.params.get("labelSelector", "")
        fields = request.params.get("fieldSelector", "")
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(raw_request(request))
        # Watch-list clients (client-go's reflector, helm's waiter) wait for a bookmark that
        # marks the end of the initial ADDED events.
        initial = -1
        if request.params.get("sendInitialEvents") == "true":
            assert request.resource is not None
            initial = sum(1 for key in self._keys_of(request.resource)
                          if not self.objects[key].deleted and request.namespace in (
                              None, key[1]))
        events: AsyncIterator[Any] = self.watch_events(request)
        try:
            if initial == 0:
                await response.write(self._initial_events_end(request))
            async for event in events:
                if not isinstance(event, dict):
                    continue
                obj = event.get("object") or {}
                if _matches_labels(obj, labels) and _matches_fields(obj, fields):
                    await response.write(json.dumps(event).encode() + b"\n")
                if initial > 0:
                    initial -= 1
                    if initial == 0:
                        await response.write(self._initial_events_end(request))
        except (ConnectionError, asyncio.CancelledError):
            pass
        return response

    def _initial_events_end(self, request: kmock.Request) -> bytes:
        assert request.resource is not None
        bookmark = {"type": "BOOKMARK", "object": {
            "kind": self._kind(request.resource),
            "apiVersion": self._api_version(request.resource),
            "metadata": {"resourceVersion": str(next(self._versions)),
                         "annotations": {"k8s.io/initial-events-end": "true"}}}}
        return json.dumps(bookmark).encode() + b"\n"

    @staticmethod
    def _wants_table(request: kmock.Request) -> bool:
        return "as=Table" in request.headers.get("Accept", "")

    async def _serve_table(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        res = request.resource
        assert res is not None
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "",
                    "priority": 0}] + [
            {"name": c["name"], "type": c["type"], "format": c.get("format", ""),
             "description": c.get("description", ""), "priority": c.get("priority", 0)}
            for c in self.printer_columns[res]]
        objs = self._select(request)
        if request.action == kmock.action.FETCH and not objs:
            raise kmock.KubernetesObjectNotFoundError()
        rows = []
        for obj in objs:
            cells: list[Any] = [obj["metadata"]["name"]]
            for col in self.printer_columns[res]:
                matches = jsonpath_parse(col["jsonPath"].lstrip(".")).find(obj)
                value = matches[0].value if matches else None
                cells.append(_age(value) if col["type"] == "date" and value else value)
            rows.append({"cells": cells, "object": {
                "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                "metadata": obj["metadata"]}})
        return aiohttp.web.json_response({
            "kind": "Table", "apiVersion": "meta.k8s.io/v1",
            "metadata": {"resourceVersion": str(next(self._versions))},
            "columnDefinitions": columns, "rows": rows})

    def openapi_v3_root(self) -> dict[str, Any]:
        """Enough OpenAPI v3 for kubectl to find server-side field validation and use it."""
        group_versions = {self._api_version(r) for r in self.declared_resources()}
        return {"paths": {
            ("api/v1" if gv == "v1" else f"apis/{gv}"): {
                "serverRelativeURL": "/openapi/v3/" + ("api/v1" if gv == "v1" else f"apis/{gv}")}
            for gv in sorted(group_versions)}}

    def openapi_v3_group(self, group_version: str) -> dict[str, Any]:
        paths: dict[str, Any] = {}
        schemas: dict[str, Any] = {}
        for res in self.declared_resources():
            if self._api_version(res) != group_version:
                continue
            prefix = f"/apis/{group_version}" if res.group else "/api/v1"
            gvk = {"group": res.group, "version": res.version, "kind": self._kind(res)}
            params = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string"}},
                      {"name": "fieldManager", "in": "query", "schema": {"type": "string"}}]
            operation = {"x-kubernetes-group-version-kind": gvk, "parameters": params,
                         "responses": {"200": {"description": "OK"}}}
            paths[f"{prefix}/namespaces/{{namespace}}/{res.plural}/{{name}}"] = {
                "patch": operation}
            paths[f"{prefix}/namespaces/{{namespace}}/{res.plural}"] = {"post": operation}
            if (schema := self.schemas.get(res)) is not None:
                # A CRD's schema under its kind, as the API server publishes it (kubectl
                # explain finds it by x-kubernetes-group-version-kind).
                name = ".".join([*reversed((res.group or "").split(".")),
                                 res.version or "", self._kind(res)])
                schemas[name] = {**copy.deepcopy(schema),
                                 "x-kubernetes-group-version-kind": [gvk]}
        return {"openapi": "3.0.0", "info": {"title": "emulator", "version": "v1"},
                "paths": paths, "components": {"schemas": schemas}}
