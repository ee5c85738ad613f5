"""The operator's only door to the Kubernetes API: list children, server-side apply, delete,
patch status, post nothing else. Every write is counted in the metrics.

Objects stay plain dicts (lightkube generic resources) so that render's output is applied as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import httpx2
from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.types import CascadeType, PatchType

from disagg_operator import metrics
from disagg_operator.association import Owner, owned_labels
from disagg_operator.child_kinds import CHILD_KINDS
from disagg_operator.field_ownership import FIELD_MANAGER
from disagg_operator.leader import LeaseRecord
from disagg_operator.render import Manifest
from disagg_operator.spec import GROUP, KIND, PLURAL, VERSION

_RESOURCES = {child.kind: create_namespaced_resource(child.group, child.version, child.kind,
                                                     child.plural) for child in CHILD_KINDS}
# Kinds a cluster serves only with an add-on installed (their CRD): listed only if served.
OPTIONAL_KINDS = tuple(child.kind for child in CHILD_KINDS if child.optional)
_POD = create_namespaced_resource("", "v1", "Pod", "pods")
_EVENT = create_namespaced_resource("", "v1", "Event", "events")
DisaggServingResource = create_namespaced_resource(GROUP, VERSION, KIND, PLURAL)
_LEASE = create_namespaced_resource("coordination.k8s.io", "v1", "Lease", "leases")

ChildKey = tuple[str, str]  # (kind, name)


@dataclass(frozen=True)
class ApiFailure(Exception):
    """A refused API call, reduced to what a user needs in a status message."""

    code: int
    reason: str
    message: str

    def __str__(self) -> str:
        return f"{self.reason} ({self.code}): {self.message}"


class ClusterApi(Protocol):
    async def serves(self, kind: str, namespace: str) -> bool: ...
    async def list_children(self, owner: Owner) -> dict[ChildKey, Manifest]: ...
    async def list_pods(self, owner: Owner) -> list[Manifest]: ...
    async def list_pod_events(self, namespace: str, reason: str) -> list[Manifest]: ...
    async def get(self, kind: str, namespace: str, name: str) -> Manifest | None: ...
    async def apply(self, manifest: Manifest, dry_run: bool = False,
                    field_manager: str = FIELD_MANAGER) -> Manifest: ...
    async def delete(self, kind: str, namespace: str, name: str) -> None: ...
    async def patch_status(self, namespace: str, name: str,
                           status_patch: dict[str, Any]) -> None: ...


class LightkubeApi:
    """ClusterApi over a lightkube AsyncClient (kubeconfig, or in-cluster service account)."""

    def __init__(self, client: AsyncClient) -> None:
        self.client = client

    async def list_pods(self, owner: Owner) -> list[Manifest]:
        """The pods of the DisaggServing's workloads (read for their container states)."""
        pods: list[Manifest] = []
        async with _translated():
            pods = [dict(item) async for item in self.client.list(
                _POD, namespace=owner.namespace, labels=dict(owned_labels(owner.name)))]
        return pods

    async def list_pod_events(self, namespace: str, reason: str) -> list[Manifest]:
        """The namespace's Events about pods with this reason (the kubelet's FailedMount says
        which Secret a waiting pod lacks); [] where the operator may not list Events."""
        events: list[Manifest] = []
        try:
            async with _translated():
                events = [dict(item) async for item in self.client.list(
                    _EVENT, namespace=namespace,
                    fields={"reason": reason, "involvedObject.kind": "Pod"})]
        except ApiFailure as err:
            if err.code != 403:
                raise
        return events

    async def get(self, kind: str, namespace: str, name: str) -> Manifest | None:
        """The object of this kind and name, whoever owns it; None if there is none."""
        found: Manifest | None = None
        try:
            async with _translated():
                found = dict(await self.client.get(_RESOURCES[kind], name, namespace=namespace))
        except ApiFailure as err:
            if err.code != 404:
                raise
        return found

    async def serves(self, kind: str, namespace: str) -> bool:
        """Whether the API server serves this kind (an add-on's CRD is installed): a list in
        the namespace the operator works in answers 404 when it does not."""
        try:
            async with _translated():
                async for _ in self.client.list(_RESOURCES[kind], namespace=namespace,
                                                chunk_size=1):
                    break
        except ApiFailure as err:
            if err.code == 404:
                return False
            raise
        return True

    async def list_children(self, owner: Owner) -> dict[ChildKey, Manifest]:
        found: dict[ChildKey, Manifest] = {}
        for kind, resource in _RESOURCES.items():
            try:
                async with _translated():
                    labels: dict[str, Any] = dict(owned_labels(owner.name))
                    async for item in self.client.list(resource, namespace=owner.namespace,
                                                       labels=labels):
                        obj = dict(item)
                        refs = obj.get("metadata", {}).get("ownerReferences") or []
                        # Same labels, another owner (a deleted namesake awaiting GC): skip.
                        if any(r.get("uid") == owner.uid for r in refs):
                            found[(kind, obj["metadata"]["name"])] = obj
            except ApiFailure as err:
                if not (err.code == 404 and kind in OPTIONAL_KINDS):
                    raise  # (an add-on kind not installed has no children)
        return found

    async def apply(self, manifest: Manifest, dry_run: bool = False,
                    field_manager: str = FIELD_MANAGER) -> Manifest:
        resource = _RESOURCES[manifest["kind"]]
        metrics.API_WRITES.labels(verb="apply-dry-run" if dry_run else "apply",
                                  kind=manifest["kind"]).inc()
        async with _translated():
            applied = await self.client.apply(resource(**manifest), field_manager=field_manager,
                                              force=True, dry_run=dry_run)
        return dict(applied)

    async def delete(self, kind: str, namespace: str, name: str) -> None:
        metrics.API_WRITES.labels(verb="delete", kind=kind).inc()
        try:
            async with _translated():
                await self.client.delete(_RESOURCES[kind], name, namespace=namespace,
                                         cascade=CascadeType.BACKGROUND)
        except ApiFailure as err:
            if err.code != 404:  # already gone is what we wanted
                raise

    async def patch_status(self, namespace: str, name: str,
                           status_patch: dict[str, Any]) -> None:
        metrics.API_WRITES.labels(verb="patch-status", kind=KIND).inc()
        async with _translated():
            await self.client.patch(DisaggServingResource.Status, name,
                                    {"status": status_patch}, namespace=namespace,
                                    patch_type=PatchType.MERGE)


class _translated:
    """Turn lightkube/httpx errors into ApiFailure, so callers handle one type."""

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if isinstance(exc, ApiError):
            status = exc.status
            raise ApiFailure(int(status.code or 0), str(status.reason or "Error"),
                             str(status.message or exc)) from exc
        if isinstance(exc, httpx2.HTTPStatusError):
            # lightkube only decodes a Status when the Content-Type is exactly application/json.
            response = exc.response
            try:
                body = response.json()
            except ValueError:
                body = {}
            reason = str(body.get("reason") or response.reason_phrase)
            message = str(body.get("message") or response.text[:300])
            raise ApiFailure(response.status_code, reason, message) from exc
        if isinstance(exc, httpx2.TransportError):
            raise ApiFailure(0, "Unreachable", f"{type(exc).__name__}: {exc}") from exc
        return False


class LightkubeLeaseStore:
    """The leader election's Lease (disagg_operator.leader.LeaseStore) over lightkube."""

    def __init__(self, client: AsyncClient, namespace: str, name: str) -> None:
        self.client, self.namespace, self.name = client, namespace, name

    async def get(self) -> LeaseRecord | None:
        try:
            async with _translated():
                found = dict(await self.client.get(_LEASE, self.name, namespace=self.namespace))
        except ApiFailure as err:
            if err.code == 404:
                return None
            raise
        spec = found.get("spec") or {}
        return LeaseRecord(holder=spec.get("holderIdentity") or "",
                           lease_seconds=int(spec.get("leaseDurationSeconds") or 0),
                           acquired=spec.get("acquireTime") or "",
                           renewed=spec.get("renewTime") or "",
                           transitions=int(spec.get("leaseTransitions") or 0),
                           version=found["metadata"].get("resourceVersion"))

    async def create(self, record: LeaseRecord) -> bool:
        return await self._write(record, create=True)

    async def update(self, record: LeaseRecord) -> bool:
        return await self._write(record, create=False)

    async def _write(self, record: LeaseRecord, create: bool) -> bool:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if record.version is not None:
            metadata["resourceVersion"] = record.version  # the write's precondition
        body: dict[str, Any] = {
            "apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": metadata,
            "spec": {"holderIdentity": record.holder,
                     "leaseDurationSeconds": record.lease_seconds,
                     "acquireTime": record.acquired, "renewTime": record.renewed,
                     "leaseTransitions": record.transitions}}
        lease = _LEASE(**body)
        metrics.API_WRITES.labels(verb="create" if create else "update", kind="Lease").inc()
        try:
            async with _translated():
                if create:
                    await self.client.create(lease)
                else:
                    await self.client.replace(lease)
        except ApiFailure as err:
            if err.code == 409:  # another candidate wrote first
                return False
            raise
        return True
