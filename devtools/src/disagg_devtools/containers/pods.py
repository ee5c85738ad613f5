"""Rendered manifests -> the pods a cluster would run, as plain data (no podman here).

What a cluster adds to an object before a container starts is done here the way Kubernetes
does it: a Deployment or StatefulSet becomes `replicas` pods, each pod gets the DNS names of the
Services that select it, env values come from field and Secret references, and `$(VAR)` in a
command or argument is replaced by the container's env var."""

from __future__ import annotations

import base64
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

CLUSTER_DOMAIN = "cluster.local"
WORKLOADS = {"Deployment", "StatefulSet", "Pod"}
# Objects that configure a cluster rather than run a process: nothing to do on podman.
NOT_RUN = {"PodDisruptionBudget", "NetworkPolicy", "ServiceAccount", "Role", "RoleBinding",
           "ClusterRole", "ClusterRoleBinding", "ServiceMonitor", "PersistentVolumeClaim"}


class UnsupportedObject(ValueError):
    """A manifest this runner cannot run faithfully; the message says which and why."""


@dataclass(frozen=True)
class PodPlan:
    name: str
    namespace: str
    workload: str  # the Deployment or StatefulSet it belongs to (its own name for a Pod)
    labels: Mapping[str, str]
    spec: Mapping[str, Any]
    hostname: str | None = None  # a StatefulSet's pods: their own name...
    subdomain: str | None = None  # ...under the StatefulSet's governing Service
    dns_names: tuple[str, ...] = field(default=())


def workload_pods(manifests: Iterable[Mapping[str, Any]], namespace: str) -> list[PodPlan]:
    """Every pod the manifests' workloads ask for, with the DNS names their Services give."""
    objects = list(manifests)
    services = [o for o in objects if o["kind"] == "Service"]
    pods: list[PodPlan] = []
    for obj in objects:
        kind = obj["kind"]
        if kind in WORKLOADS:
            pods += _expand(obj, namespace)
        elif kind not in NOT_RUN | {"Service", "ConfigMap", "Secret"}:
            raise UnsupportedObject(f"{kind} {obj['metadata']['name']}: not run on podman")
    for service in services:
        _check_ports(service, [p for p in pods if _selects(service, p.labels)])
    return [_with_dns_names(pod, services) for pod in pods]


def _expand(obj: Mapping[str, Any], namespace: str) -> list[PodPlan]:
    name = obj["metadata"]["name"]
    if obj["kind"] == "Pod":
        return [PodPlan(name, namespace, name, obj["metadata"].get("labels", {}), obj["spec"])]
    spec = obj["spec"]
    template = spec["template"]
    labels = template.get("metadata", {}).get("labels", {})
    pods = []
    for index in range(int(spec.get("replicas", 1))):
        pod_name = f"{name}-{index}"
        if obj["kind"] == "StatefulSet":
            pods.append(PodPlan(pod_name, namespace, name, labels, template["spec"],
                                hostname=pod_name, subdomain=spec.get("serviceName")))
        else:
            pods.append(PodPlan(pod_name, namespace, name, labels, template["spec"]))
    return pods


def _selects(service: Mapping[str, Any], labels: Mapping[str, str]) -> bool:
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def _check_ports(service: Mapping[str, Any], pods: list[PodPlan]) -> None:
    """A podman network has no Service IPs to translate ports: each Service port must be the
    port its pods listen on."""
    for port in service["spec"].get("ports", []):
        target = port.get("targetPort", port["port"])
        for pod in pods:
            listened = {p.get("name"): p["containerPort"]
                        for c in pod.spec["containers"] for p in c.get("ports", [])}
            number = listened.get(target) if isinstance(target, str) else target
            if number != port["port"]:
                raise UnsupportedObject(
                    f"Service {service['metadata']['name']} port {port['port']} reaches "
                    f"{pod.name} on {number}: podman cannot translate Service ports")


def _with_dns_names(pod: PodPlan, services: list[Mapping[str, Any]]) -> PodPlan:
    names: list[str] = []
    for service in services:
        svc = service["metadata"]["name"]
        if _selects(service, pod.labels):
            names += _qualified(svc, pod.namespace)
        if pod.subdomain == svc and pod.hostname:
            # A headless Service's pods each get <pod>.<service>.<namespace>.svc...
            names += _qualified(f"{pod.hostname}.{svc}", pod.namespace)
    return PodPlan(pod.name, pod.namespace, pod.workload, pod.labels, pod.spec,
                   pod.hostname, pod.subdomain, tuple(dict.fromkeys(names)))


def _qualified(name: str, namespace: str) -> list[str]:
    return [name, f"{name}.{namespace}", f"{name}.{namespace}.svc",
            f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]


@dataclass(frozen=True)
class PodFacts:
    """What the kubelet knows once the pod's sandbox exists."""

    name: str
    namespace: str
    ip: str


def container_env(container: Mapping[str, Any], facts: PodFacts,
                  secrets: Mapping[str, Mapping[str, Any]],
                  config_maps: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """The container's environment, in order, each value expanded over the ones before it."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(str(var["value"]), env)
        elif "valueFrom" in var:
            env[var["name"]] = _value_from(var["name"], var["valueFrom"], facts, secrets,
                                           config_maps)
    return env


_FIELDS = {"metadata.name": lambda f: f.name, "metadata.namespace": lambda f: f.namespace,
           "status.podIP": lambda f: f.ip}


def _value_from(name: str, source: Mapping[str, Any], facts: PodFacts,
                secrets: Mapping[str, Mapping[str, Any]],
                config_maps: Mapping[str, Mapping[str, Any]]) -> str:
    if "fieldRef" in source:
        path = source["fieldRef"]["fieldPath"]
        if path not in _FIELDS:
            raise UnsupportedObject(f"env {name}: fieldRef {path} is not supported")
        return str(_FIELDS[path](facts))
    for kind, store in (("secretKeyRef", secrets), ("configMapKeyRef", config_maps)):
        if kind in source:
            ref = source[kind]
            data = object_data(store.get(ref["name"]) or {})
            if ref["key"] not in data:
                # The kubelet does not start a container whose env names a missing key.
                raise MissingReference(f"env {name}: {kind} {ref['name']}/{ref['key']}")
            return data[ref["key"]].decode()
    raise UnsupportedObject(f"env {name}: valueFrom {sorted(source)} is not supported")


class MissingReference(RuntimeError):
    """A Secret or ConfigMap (or key) a pod needs does not exist: the pod waits, as on a
    cluster (CreateContainerConfigError)."""


def object_data(obj: Mapping[str, Any]) -> dict[str, bytes]:
    """A ConfigMap's or Secret's files: data (base64 for a Secret), stringData, binaryData."""
    files: dict[str, bytes] = {}
    secret = obj.get("kind") == "Secret"
    for key, value in (obj.get("data") or {}).items():
        files[key] = base64.b64decode(value) if secret else str(value).encode()
    for key, value in (obj.get("binaryData") or {}).items():
        files[key] = base64.b64decode(value)
    for key, value in (obj.get("stringData") or {}).items():
        files[key] = str(value).encode()
    return files


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined VAR is replaced, an undefined one kept as
    written, and $$ stands for one $."""
    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))
    return _REFERENCE.sub(replace, text)


def command_line(container: Mapping[str, Any], env: Mapping[str, str]) -> tuple[list[str] | None,
                                                                               list[str]]:
    """(entrypoint or None for the image's, arguments), expanded."""
    command = container.get("command")
    args = [expand(str(a), env) for a in container.get("args", [])]
    return ([expand(str(c), env) for c in command] if command else None), args
