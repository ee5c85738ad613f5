"""Render: a DisaggServing's plan into the Kubernetes objects that should exist. Pure,
golden-tested; it reads the plan only (the spec was read once, by `plan.build_plan`).

Every object carries the standard `app.kubernetes.io/*` labels and a controller ownerReference
to the DisaggServing (`association`), so Kubernetes garbage-collects them with it.
"""

from __future__ import annotations

import copy
import hashlib
import json
from typing import Any

from disagg_operator import plan as plans
from disagg_operator.association import (
    CONFIG,
    ETCD,
    ETCD_CLIENT,
    Owner,
    child_labels,
    child_meta,
    child_name,
    selector_labels,
)
from disagg_operator.plan import Role
from disagg_operator.render_isolation import render_isolation
from disagg_operator.spec import DisaggServingSpec, RoleSpec, gpus_per_pod

# A hash of the config files a pod reads (mooncake.json): a change rolls the pods, which
# otherwise would keep the settings they started with while the ConfigMap says otherwise.
ANNOTATION_CONFIG_HASH = "serving.disagg.dev/config-hash"
GPU_RESOURCE = "nvidia.com/gpu"
LWS_GROUP = "leaderworkerset.x-k8s.io"
# The LeaderWorkerSet controller's label on each pod of a group: "0" is the leader.
LWS_WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"
LWS_EXCLUSIVE_TOPOLOGY = "leaderworkerset.sigs.k8s.io/exclusive-topology"
NONROOT_UID = 1000

Manifest = dict[str, Any]

# Requests and memory limits for the small components when the spec sets none. No CPU limits:
# throttling a latency-critical path (proxy, master RPCs) costs more than it protects.
DEFAULT_RESOURCES: dict[str, dict[str, Any]] = {
    "etcd": {"requests": {"cpu": "100m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    "mooncake-master": {"requests": {"cpu": "200m", "memory": "256Mi"},
                        "limits": {"memory": "2Gi"}},
    "proxy": {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}},
    # Store-aware routing loads the tokenizer and vLLM's hashing (with torch): ~600 MiB measured.
    "proxy-store-routing": {"requests": {"cpu": "500m", "memory": "768Mi"},
                            "limits": {"memory": "2Gi"}},
}

def render_spec(owner: Owner, spec: DisaggServingSpec, default_image: str,
                cluster_domain: str = "cluster.local",
                operator_namespace: str | None = None) -> list[Manifest]:
    """`render` of the plan a spec gives in a cluster (the CLI's and the tests' shortcut)."""
    addressing = plans.ClusterAddressing(owner.namespace, cluster_domain)
    return render(owner, plans.build_plan(owner.name, owner.namespace, spec, addressing),
                  default_image, operator_namespace)


def render(owner: Owner, plan: plans.Plan, default_image: str,
           operator_namespace: str | None = None) -> list[Manifest]:
    """All desired children, in apply order (config and dependencies first). The operator's
    namespace, when it runs in the cluster, lets it through the NetworkPolicies."""
    image = plan.image or default_image
    objects: list[Manifest] = []
    if plan.config_files:
        objects.append({
            "apiVersion": "v1", "kind": "ConfigMap",
            "metadata": child_meta(owner, child_name(owner.name, CONFIG), "config"),
            "data": dict(sorted(plan.config_files.items())),
        })
    for component in plan.components:
        objects.extend(_render_component(owner, plan, component, image))
    objects.extend(render_isolation(owner, plan, operator_namespace))
    return objects


def _render_component(owner: Owner, plan: plans.Plan, component: plans.Component,
                      image: str) -> list[Manifest]:
    role = component.role
    name = child_name(owner.name, role)
    if role == Role.ETCD:
        return _render_etcd(owner, plan, component)
    pod = _pod_template(owner, plan, component, image)
    if component.nodes > 1:
        return _render_group(owner, plan, component, image, pod)
    workload_spec: dict[str, Any] = {
        "replicas": component.replicas,
        "selector": {"matchLabels": selector_labels(owner.name, role)},
        "template": pod,
    }
    if role.is_vllm:
        # New instances start beside the old ones, and an old one goes only for a new one that
        # is ready, which with the registrar's startup check means one that can pair.
        workload_spec["strategy"] = {"type": "RollingUpdate", "rollingUpdate": {
            "maxSurge": "25%", "maxUnavailable": 0}}
    if component.scaled_externally:
        # Not applied, so not owned: the HPA's (or KEDA's) writes through /scale stay.
        del workload_spec["replicas"]
    workload = {"apiVersion": "apps/v1", "kind": "Deployment",
                "metadata": child_meta(owner, name, role), "spec": workload_spec}
    if role == Role.STORE:
        return [workload]  # clients find store pods through the master, never a Service
    # Instances find each other through etcd; a headless Service gives them stable DNS.
    service = _service(owner, name, component, headless=role.is_vllm,
                       service_type=component.service_type)
    return [workload, service]


def _render_group(owner: Owner, plan: plans.Plan, component: plans.Component, image: str,
                  leader: dict[str, Any]) -> list[Manifest]:
    """Instances spanning nodes: a LeaderWorkerSet, one group of `nodes` pods per instance.
    A pod that restarts takes its group with it (the ranks cannot rejoin a running instance);
    only the leader serves, is probed and registers."""
    name = child_name(owner.name, component.role)
    group: dict[str, Any] = {
        "replicas": component.replicas,
        "startupPolicy": "LeaderCreated",
        # As for one-node instances: a new group starts beside the old ones (one spare group
        # of nodes per role during a rollout), and an old group goes only for a ready new one.
        "rolloutStrategy": {"type": "RollingUpdate", "rollingUpdateConfiguration": {
            "maxUnavailable": 0, "maxSurge": 1}},
        "leaderWorkerTemplate": {
            "size": component.nodes,
            "restartPolicy": "RecreateGroupOnPodRestart",
            "leaderTemplate": leader,
            "workerTemplate": _pod_template(owner, plan, component, image, worker=True),
        },
    }
    if component.scaled_externally:
        del group["replicas"]
    metadata = child_meta(owner, name, component.role)
    role_spec = component.role_spec
    if role_spec is not None and role_spec.exclusive_topology:
        # The LeaderWorkerSet controller then places one group per value of this node label.
        metadata["annotations"] = {LWS_EXCLUSIVE_TOPOLOGY: role_spec.exclusive_topology}
    workload = {"apiVersion": f"{LWS_GROUP}/v1", "kind": "LeaderWorkerSet",
                "metadata": metadata, "spec": group}
    service = _service(owner, name, component, headless=True, leaders_only=True)
    return [workload, service]


def _service(owner: Owner, name: str, component: plans.Component, *, headless: bool,
             service_type: str = "ClusterIP", leaders_only: bool = False) -> Manifest:
    selector = selector_labels(owner.name, component.role)
    if leaders_only:
        selector = {**selector, LWS_WORKER_INDEX_LABEL: "0"}
    service_spec: dict[str, Any] = {
        "selector": selector,
        "ports": [{"name": port_name, "port": port, "targetPort": port_name, "protocol": "TCP"}
                  for port_name, port in component.main.ports],
    }
    if headless:
        service_spec["clusterIP"] = "None"
        service_spec["publishNotReadyAddresses"] = False
    else:
        service_spec["type"] = service_type
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": child_meta(owner, name, component.role), "spec": service_spec}


def _env(process: plans.Process, extra: list[dict[str, Any]] | None = None) -> list[Any]:
    env: list[dict[str, Any]] = []
    for key, value in process.env:
        if isinstance(value, plans.PodIP):
            env.append({"name": key, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
        elif isinstance(value, plans.PodName):
            env.append({"name": key, "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}})
        elif isinstance(value, plans.SecretKey):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {
                "name": value.name, "key": value.key}}})
        else:
            env.append({"name": key, "value": value})
    return env + list(extra or [])


def _probe(process: plans.Process, *, period: int, failures: int) -> dict[str, Any]:
    port_name = process.health_port or process.ports[0][0]
    action: dict[str, Any] = ({"httpGet": {"path": process.health_path, "port": port_name}}
                              if process.health_path else {"tcpSocket": {"port": port_name}})
    return {**action, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def _container_security(*, read_only: bool, add_caps: tuple[str, ...] = ()) -> dict[str, Any]:
    caps: dict[str, Any] = {"drop": ["ALL"]}
    if add_caps:
        caps["add"] = list(add_caps)
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": read_only,
            "capabilities": caps}


def _container(process: plans.Process, image: str, pull_policy: str,
               security: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": process.name,
        "image": image,
        "imagePullPolicy": pull_policy,
        "command": list(process.command[:1]),
        "args": list(process.command[1:]),
        "env": _env(process),
        "securityContext": security,
    }
    if process.ports:
        container["ports"] = [{"name": n, "containerPort": p, "protocol": "TCP"}
                              for n, p in process.ports]
    if process.pre_stop:
        container["lifecycle"] = {"preStop": {"exec": {"command": list(process.pre_stop)}}}
    if process.secret_mounts:
        container["volumeMounts"] = [{"name": m.volume, "mountPath": m.path, "readOnly": True}
                                     for m in process.secret_mounts]
    return container


def _writable_tmp(containers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A /tmp volume for each container with a read-only root: Python's tempfile, torch,
    Hugging Face and glog write there, and a cluster adds nothing writable by itself."""
    read_only = [c for c in containers if c["securityContext"]["readOnlyRootFilesystem"]]
    for container in read_only:
        container["volumeMounts"] = [*container.get("volumeMounts", []),
                                     {"name": "tmp", "mountPath": "/tmp"}]
    return [{"name": "tmp", "emptyDir": {"sizeLimit": "256Mi"}}] if read_only else []


def _secret_volumes(processes: list[plans.Process]) -> list[dict[str, Any]]:
    """The pod volumes of its containers' Secret mounts, each once; group-readable (the
    pod's fsGroup), never world-readable."""
    found: dict[str, dict[str, Any]] = {}
    for process in processes:
        for mount in process.secret_mounts:
            found.setdefault(mount.volume, {"name": mount.volume, "secret": {
                "secretName": mount.secret, "defaultMode": 0o440}})
    return list(found.values())


def _pod_template(owner: Owner, plan: plans.Plan, component: plans.Component,
                  image: str, worker: bool = False) -> dict[str, Any]:
    """A pod of the component; `worker`: one of a multi-node instance's other nodes (its
    headless ranks: no API server, so no probes, no registrar and no drain hook)."""
    role = component.role
    role_spec = component.role_spec
    process = component.worker if worker and component.worker else component.main
    main = _container(process, image, plan.image_pull_policy, _container_security(
        # vLLM and torch write compile caches under the home directory.
        read_only=not role.is_vllm, add_caps=component.add_capabilities))
    volumes: list[dict[str, Any]] = []
    annotations: dict[str, str] = {}
    mounts: list[dict[str, Any]] = []
    if process.ports:
        main["readinessProbe"] = _probe(process, period=5, failures=3)
        main["livenessProbe"] = _probe(process, period=15, failures=4)
    containers = [main]
    if role_spec is not None:
        if process.ports:
            # Loading weights can take many minutes: the startup probe holds liveness off.
            main["startupProbe"] = _probe(process, period=10, failures=180)
        # A refused configuration (e.g. the connector's) ends in the log: the operator quotes
        # it in the status's Degraded condition.
        main["terminationMessagePolicy"] = "FallbackToLogsOnError"
        main["env"] += list(role_spec.env or [])
        main["resources"] = _vllm_resources(role_spec)
    else:
        main["resources"] = copy.deepcopy(dict(component.resources or {})
                                          or _default_resources(component))
    if component.network is not None and component.network.rdma_resource:
        for kind in ("requests", "limits"):
            main["resources"].setdefault(kind, {})[component.network.rdma_resource] = 1
    if component.model_cache is not None:
        mounts += [{"name": "model-cache", "mountPath": component.model_cache.mount_path},
                   {"name": "dshm", "mountPath": "/dev/shm"}]
        shm: dict[str, Any] = {"medium": "Memory"}
        if role_spec is not None and role_spec.shared_memory_size is not None:
            shm["sizeLimit"] = role_spec.shared_memory_size
        volumes += [_model_cache_volume(component.model_cache),
                    {"name": "dshm", "emptyDir": shm}]
    if component.reads_config and plan.config_files:
        mounts.append({"name": "config", "mountPath": plans.CONFIG_DIR, "readOnly": True})
        volumes.append({"name": "config",
                        "configMap": {"name": child_name(owner.name, CONFIG)}})
        annotations[ANNOTATION_CONFIG_HASH] = config_hash(plan.config_files)
    if component.model_claim is not None:
        mounts.append({"name": "model-cache", "mountPath": component.model_claim.mount_path,
                       "readOnly": True})
        volumes.append({"name": "model-cache", "persistentVolumeClaim": {
            "claimName": component.model_claim.pvc_claim_name, "readOnly": True}})
    if component.cache_dir:
        mounts.append({"name": "cache", "mountPath": component.cache_dir})
        volumes.append({"name": "cache", "emptyDir": {"sizeLimit": "1Gi"}})
    if mounts:
        main["volumeMounts"] = [*mounts, *main.get("volumeMounts", [])]
    sidecars = () if worker else component.sidecars
    volumes += _secret_volumes([process, *sidecars])
    for sidecar in sidecars:
        side = _container(sidecar, image, plan.image_pull_policy,
                          _container_security(read_only=True))
        if sidecar.startup_check:
            # Never run again once it succeeds; an hour of failures restarts the sidecar.
            side["startupProbe"] = {"exec": {"command": list(sidecar.startup_check)},
                                    "periodSeconds": 5, "failureThreshold": 720,
                                    "timeoutSeconds": 5}
        side["resources"] = {"requests": {"cpu": "10m", "memory": "64Mi"},
                             "limits": {"memory": "128Mi"}}
        containers.append(side)
    volumes += _writable_tmp(containers)
    annotations.update(component.annotations)

    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": NONROOT_UID,
                            "runAsGroup": NONROOT_UID, "fsGroup": NONROOT_UID,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": containers,
    }
    if component.stop_grace_seconds is not None:
        pod_spec["terminationGracePeriodSeconds"] = component.stop_grace_seconds
    if volumes:
        pod_spec["volumes"] = volumes
    if plan.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in plan.image_pull_secrets]
    if component.network is not None and component.network.host_network:
        pod_spec["hostNetwork"] = True
        pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"  # Services still resolve
    if role_spec is not None:
        _place(pod_spec, role_spec, owner)
    template: dict[str, Any] = {"metadata": {"labels": child_labels(owner.name, role)},
                                "spec": pod_spec}
    if annotations:
        template["metadata"]["annotations"] = annotations
    if role_spec is not None and role_spec.pod_template:
        template = merge_pod_template(template, role_spec.pod_template)
    return template


def _default_resources(component: plans.Component) -> dict[str, Any]:
    if component.role == Role.PROXY and component.reads_config:
        return DEFAULT_RESOURCES["proxy-store-routing"]
    return DEFAULT_RESOURCES[component.role]


def config_hash(files: dict[str, str]) -> str:
    blob = json.dumps(files, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _vllm_resources(role_spec: RoleSpec) -> dict[str, Any]:
    if role_spec.resources:
        return copy.deepcopy(role_spec.resources)
    gpus = gpus_per_pod(role_spec)
    return {"limits": {GPU_RESOURCE: gpus}, "requests": {GPU_RESOURCE: gpus}}


def _model_cache_volume(cache: plans.ModelCache) -> dict[str, Any]:
    if cache.pvc_claim_name:
        return {"name": "model-cache",
                "persistentVolumeClaim": {"claimName": cache.pvc_claim_name}}
    empty: dict[str, Any] = {}
    if cache.empty_dir_size_limit is not None:
        empty["sizeLimit"] = cache.empty_dir_size_limit
    return {"name": "model-cache", "emptyDir": empty}


def _place(pod_spec: dict[str, Any], role_spec: RoleSpec, owner: Owner) -> None:
    if role_spec.node_selector:
        pod_spec["nodeSelector"] = dict(role_spec.node_selector)
    if role_spec.tolerations:
        pod_spec["tolerations"] = copy.deepcopy(role_spec.tolerations)
    if role_spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(role_spec.affinity)
    near = role_spec.affinity_to_prefill
    if near is not None:
        term = {"topologyKey": near.topology_key,
                "labelSelector": {"matchLabels": selector_labels(owner.name, Role.PREFILL)}}
        affinity = pod_spec.setdefault("affinity", {}).setdefault("podAffinity", {})
        if near.required:
            affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution",
                                []).append(term)
        else:
            affinity.setdefault("preferredDuringSchedulingIgnoredDuringExecution", []).append(
                {"weight": 100, "podAffinityTerm": term})


def _render_etcd(owner: Owner, plan: plans.Plan,
                 component: plans.Component) -> list[Manifest]:
    name = child_name(owner.name, ETCD)
    assert component.image is not None, "etcd runs its own image"
    main = _container(component.main, component.image, plan.image_pull_policy,
                      _container_security(read_only=True))
    main["volumeMounts"] = [{"name": "data", "mountPath": "/var/lib/etcd"},
                            *main.get("volumeMounts", [])]
    main["readinessProbe"] = _probe(component.main, period=5, failures=3)
    main["livenessProbe"] = _probe(component.main, period=15, failures=4)
    main["resources"] = copy.deepcopy(dict(component.resources or {})
                                      or DEFAULT_RESOURCES[Role.ETCD])
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": 65532, "runAsGroup": 65532,
                            "fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [main],
    }
    sts_spec: dict[str, Any] = {
        "replicas": component.replicas,
        "serviceName": name,
        "selector": {"matchLabels": selector_labels(owner.name, Role.ETCD)},
        "template": {"metadata": {"labels": child_labels(owner.name, Role.ETCD)},
                     "spec": pod_spec},
    }
    if component.storage_size is not None:
        sts_spec["volumeClaimTemplates"] = [{
            "metadata": {"name": "data"},
            "spec": {"accessModes": ["ReadWriteOnce"],
                     "resources": {"requests": {"storage": component.storage_size}}},
        }]
    else:
        pod_spec["volumes"] = [{"name": "data", "emptyDir": {}}]
    pod_spec["volumes"] = [*pod_spec.get("volumes", []), *_writable_tmp([main])]
    if secrets := _secret_volumes([component.main]):
        pod_spec["volumes"] = [*pod_spec.get("volumes", []), *secrets]
    statefulset = {"apiVersion": "apps/v1", "kind": "StatefulSet",
                   "metadata": child_meta(owner, name, Role.ETCD), "spec": sts_spec}
    peers = _service(owner, name, component, headless=True)
    peers["spec"]["publishNotReadyAddresses"] = True  # members must find each other to start
    client = _service(owner, child_name(owner.name, ETCD_CLIENT), component, headless=False)
    client["spec"]["ports"] = [p for p in client["spec"]["ports"]
                               if p["name"] in ("client", "metrics")]
    return [statefulset, peers, client]


def merge_pod_template(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """Merge a partial PodTemplateSpec over `base` like a strategic merge patch.

    Maps merge recursively; lists of named items (containers, env, volumes, volumeMounts, ports)
    merge by name; other lists are replaced.
    """
    result = copy.deepcopy(base)
    for key, value in override.items():
        current = result.get(key)
        if isinstance(current, dict) and isinstance(value, dict):
            result[key] = merge_pod_template(current, value)
        elif isinstance(current, list) and isinstance(value, list) and _named(current + value):
            by_name = {item["name"]: item for item in current}
            for item in value:
                if item["name"] in by_name:
                    by_name[item["name"]] = merge_pod_template(by_name[item["name"]], item)
                else:
                    by_name[item["name"]] = copy.deepcopy(item)
            result[key] = list(by_name.values())
        else:
            result[key] = copy.deepcopy(value)
    return result


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)
