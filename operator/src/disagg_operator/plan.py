"""The plan: every process of a DisaggServing with its command line, env, ports and config files.

One plan feeds both the Kubernetes manifests (`render.py`) and a local process runner, so the two
never drift. Only *addresses* differ between them, and those come from an `Addressing`.
This module is pure: no I/O, no clock, no randomness.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from disagg_operator.association import ETCD, ETCD_CLIENT, MOONCAKE_MASTER, child_name
from disagg_operator.quantity import parse_quantity
from disagg_operator.spec import (
    ConnectorName,
    DisaggServingSpec,
    NetworkPolicySpec,
    RoleSpec,
    SecretKeyRef,
    store_routing,
)

CONFIG_DIR = "/etc/disagg"
MOONCAKE_CONFIG_FILE = "mooncake.json"
KVHELPER_CONNECTOR_MODULE = "kvhelper.connector"
KVHELPER_CONNECTOR_CLASS = "MooncakeStoreConnector"
VLLM_PORT = 8000
# The proxy's writable directory (its root filesystem is read-only): the tokenizer's download.
PROXY_CACHE_DIR = "/var/cache/disagg-proxy"
# On vLLM pods: what prefill and decode must share (compatibility_labels), for people reading.
ANNOTATION_COMPAT = "serving.disagg.dev/compatibility"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
ETCD_METRICS_PORT = 2381  # a managed etcd's /health and /metrics, over plain HTTP, with TLS
# Where containers find etcd TLS files (cert-manager's layout: ca.crt, tls.crt, tls.key).
ETCD_CLIENT_TLS_DIR = "/etc/disagg-etcd-client-tls"
ETCD_SERVER_TLS_DIR = "/etc/etcd-tls"
STORE_HTTP_PORT = 9300  # the store pod's /health and /metrics
MULTI_NODE_PORT = 29500  # where an instance's node-rank 0 gathers its other nodes
# Set by the LeaderWorkerSet controller in every pod of a group.
LWS_WORKER_INDEX = "LWS_WORKER_INDEX"
LWS_LEADER_ADDRESS = "LWS_LEADER_ADDRESS"
STORE_RPC_PORT = 50052



class Role(enum.StrEnum):
    """What a component is; its value is the child's name suffix and its component label."""
    PREFILL = "prefill"
    DECODE = "decode"
    PROXY = "proxy"
    MOONCAKE_MASTER = "mooncake-master"
    STORE = "store"
    ETCD = "etcd"

    @property
    def is_vllm(self) -> bool:
        return self in (Role.PREFILL, Role.DECODE)


VLLMRole = Literal[Role.PREFILL, Role.DECODE]
VLLM_ROLES: tuple[VLLMRole, ...] = (Role.PREFILL, Role.DECODE)


@dataclass(frozen=True)
class PodIP:
    """An env value: the address of the process's own host (pod IP, or loopback locally)."""


@dataclass(frozen=True)
class PodName:
    """An env value: the process's own instance name (pod name)."""


@dataclass(frozen=True)
class SecretKey:
    """An env value read from a Secret key; never rendered into args or logs."""

    name: str
    key: str
    field: str  # the spec field that names the Secret, for messages

    @classmethod
    def of(cls, ref: SecretKeyRef, field: str) -> SecretKey:
        return cls(ref.name, ref.key, field)


EnvValue = str | PodIP | PodName | SecretKey


@dataclass(frozen=True)
class SecretMount:
    """A Secret's files, read-only in one process's container (Kubernetes only)."""

    volume: str
    secret: str
    path: str
    field: str  # the spec field that names the Secret, for messages


@dataclass(frozen=True)
class Process:
    """One long-running process (a container in Kubernetes)."""
    name: str
    command: tuple[str, ...]
    env: tuple[tuple[str, EnvValue], ...] = ()
    ports: tuple[tuple[str, int], ...] = ()
    health_path: str | None = None  # HTTP readiness path on the first port; None: TCP check
    # Run before the process is stopped (a preStop hook in Kubernetes): its graceful drain.
    pre_stop: tuple[str, ...] = ()
    # Succeeds once the process may count as started (an exec startup probe in Kubernetes).
    startup_check: tuple[str, ...] = ()
    secret_mounts: tuple[SecretMount, ...] = ()
    health_port: str | None = None  # the port its probes use; None: the first


@dataclass(frozen=True)
class ModelCache:
    """Where a vLLM pod keeps model weights (HF_HOME): a PVC, or an emptyDir."""

    mount_path: str
    pvc_claim_name: str | None = None
    empty_dir_size_limit: str | int | None = None


@dataclass(frozen=True)
class PodNetwork:
    host_network: bool = False
    rdma_resource: str | None = None  # one of this extended resource per pod


def pod_network(spec: DisaggServingSpec) -> PodNetwork:
    mooncake = spec.kv_transfer.mooncake
    return PodNetwork(spec.pod_network.host_network,
                      mooncake.rdma_resource if mooncake.protocol == "rdma" else None)


def network_annotations(spec: DisaggServingSpec) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((spec.pod_network.annotations or {}).items()))


@dataclass(frozen=True)
class Component:
    """A group of identical processes: a Deployment or StatefulSet in Kubernetes."""

    role: Role
    replicas: int
    main: Process
    sidecars: tuple[Process, ...] = ()
    role_spec: RoleSpec | None = None  # placement and resources of vLLM roles
    reads_config: bool = False  # mounts config_files at CONFIG_DIR
    cache_dir: str | None = None  # a writable scratch directory (an emptyDir in a pod)
    # In Kubernetes only:
    resources: Mapping[str, Any] | None = None  # None: the renderer's default for the role
    image: str | None = None  # its own image (etcd); None: the serving image
    service_type: str = "ClusterIP"  # of its Service (the proxy's is the spec's)
    add_capabilities: tuple[str, ...] = ()  # IPC_LOCK for RDMA
    model_cache: ModelCache | None = None  # vLLM roles
    # The model's claim mounted read-only (the proxy's tokenizer, when model.name is a path on
    # it); None where the model cache is a per-pod emptyDir.
    model_claim: ModelCache | None = None
    storage_size: str | int | None = None  # etcd's data volume claim; None: an emptyDir
    annotations: tuple[tuple[str, str], ...] = ()  # on its pods
    stop_grace_seconds: int | None = None  # from SIGTERM (or pre_stop) to SIGKILL
    # Its instance count is set by an external scaler (HPA, KEDA) through the workload's
    # /scale; `replicas` is then only where a runner without one starts.
    scaled_externally: bool = False
    # An instance spanning nodes: `nodes` pods, the first running `main`, the others `worker`.
    nodes: int = 1
    worker: Process | None = None
    network: PodNetwork | None = None  # vLLM and store pods: host network, RDMA devices


@dataclass(frozen=True)
class Plan:
    name: str
    etcd_endpoints: tuple[str, ...]
    etcd_managed: bool
    registry_prefix: str
    mooncake_master_address: str | None
    # How the operator checks etcd: None, gRPC to etcd_endpoints; "metrics", plain HTTP
    # /health on a managed etcd's metrics port (its client port wants a certificate);
    # "https", /health on etcd_endpoints with the operator's own client certificate.
    etcd_health_via: str | None = None
    config_files: dict[str, str] = field(default_factory=dict)  # file name -> content
    components: tuple[Component, ...] = ()
    # In Kubernetes only:
    image: str | None = None  # the serving image; None: the operator's default
    image_pull_policy: str = "IfNotPresent"
    image_pull_secrets: tuple[str, ...] = ()
    proxy_port: int = 8000  # where clients reach the proxy's Service
    network_policy: NetworkPolicySpec | None = None  # None: no NetworkPolicies

    def component(self, role: Role) -> Component | None:
        return next((c for c in self.components if c.role == role), None)

    def secret_fields(self) -> dict[str, tuple[str, ...]]:
        """Each Secret the pods read (mounted or as env values), with the spec fields that
        name it: what a status message points at when the Secret is missing."""
        found: dict[str, list[str]] = {}
        for component in self.components:
            for process in (component.main, *component.sidecars, *(
                    [component.worker] if component.worker else [])):
                named = [(m.secret, m.field) for m in process.secret_mounts] + [
                    (v.name, v.field) for _, v in process.env if isinstance(v, SecretKey)]
                for secret, spec_field in named:
                    if spec_field not in found.setdefault(secret, []):
                        found[secret].append(spec_field)
        return {secret: tuple(fields) for secret, fields in found.items()}


class Addressing(Protocol):
    """Where one component reaches another: Service DNS names in a cluster, loopback locally."""

    def etcd_endpoints(self, name: str) -> tuple[str, ...]: ...
    def mooncake_master(self, name: str, port: int) -> str: ...
    def registration_url(self) -> str: ...


@dataclass(frozen=True)
class ClusterAddressing:
    namespace: str
    cluster_domain: str = "cluster.local"

    def service_host(self, service: str) -> str:
        return f"{service}.{self.namespace}.svc.{self.cluster_domain}"

    def etcd_endpoints(self, name: str) -> tuple[str, ...]:
        return (f"{self.service_host(child_name(name, ETCD_CLIENT))}:{ETCD_CLIENT_PORT}",)

    def mooncake_master(self, name: str, port: int) -> str:
        return f"{self.service_host(child_name(name, MOONCAKE_MASTER))}:{port}"

    def registration_url(self) -> str:
        # Expanded by Kubernetes from the POD_IP env var declared before it.
        return f"http://$(POD_IP):{VLLM_PORT}"


def build_plan(name: str, namespace: str, spec: DisaggServingSpec,
               addressing: Addressing) -> Plan:
    etcd_managed = spec.etcd.mode == "Managed"
    etcd_endpoints = (addressing.etcd_endpoints(name) if etcd_managed
                      else tuple(spec.etcd.endpoints))
    uses_store = spec.kv_transfer.connector == ConnectorName.MOONCAKE_STORE
    master_ha = uses_store and spec.mooncake_master.replicas > 1
    if master_ha:  # clients find the elected master through etcd
        master: str | None = "etcd://" + ";".join(etcd_endpoints)
    else:
        master = (addressing.mooncake_master(name, spec.mooncake_master.port)
                  if uses_store else None)
    # Masters in HA mode and their clients agree on the key their election writes.
    store_env: tuple[tuple[str, EnvValue], ...] = (
        (("MC_STORE_CLUSTER_ID", f"{namespace}.{name}"),) if master_ha else ())
    # Namespaced, so that DisaggServings sharing an external etcd never see each other.
    registry_prefix = f"/disagg/{namespace}/{name}/instances/"
    config_files: dict[str, str] = {}
    if uses_store and master is not None:
        config_files[MOONCAKE_CONFIG_FILE] = mooncake_config_json(spec, master, etcd_endpoints)

    components: list[Component] = []
    if etcd_managed:
        components.append(_etcd_component(name, spec))
    if uses_store:
        components.append(_mooncake_master_component(spec, etcd_endpoints, store_env))
        if spec.store.replicas and master is not None:
            components.append(_store_component(spec, master, etcd_endpoints, store_env))
    for role in VLLM_ROLES:
        components.append(_vllm_component(role, spec, etcd_endpoints, registry_prefix,
                                          addressing, store_env))
    components.append(_proxy_component(spec, etcd_endpoints, registry_prefix,
                                       bool(config_files), store_env))
    health_via = None if spec.etcd.tls is None else "metrics" if etcd_managed else "https"
    return Plan(name=name, etcd_endpoints=etcd_endpoints, etcd_managed=etcd_managed,
                registry_prefix=registry_prefix, mooncake_master_address=master,
                etcd_health_via=health_via,
                config_files=config_files, components=tuple(components),
                image=spec.image, image_pull_policy=spec.image_pull_policy,
                image_pull_secrets=tuple(s.name for s in spec.image_pull_secrets),
                proxy_port=spec.proxy.service.port,
                network_policy=spec.network_policy if spec.network_policy.enabled else None)


def kv_transfer_config(role: VLLMRole, spec: DisaggServingSpec) -> dict[str, object]:
    """vLLM's --kv-transfer-config for one role; the only place that decides it."""
    connector = spec.kv_transfer.connector
    extra: dict[str, object] = {}
    if connector == ConnectorName.MOONCAKE_STORE and spec.kv_transfer.implementation == "kvhelper":
        extra["mooncake_config_path"] = f"{CONFIG_DIR}/{MOONCAKE_CONFIG_FILE}"
    if connector == ConnectorName.MOONCAKE_STORE:
        if spec.kv_transfer.save_decode_cache and role == Role.DECODE:
            extra["save_decode_cache"] = True
    extra.update(spec.kv_transfer.extra_config)
    prefill_tp, decode_tp = (spec.prefill.tensor_parallel_size,
                             spec.decode.tensor_parallel_size)
    if connector == ConnectorName.MOONCAKE_STORE and prefill_tp != decode_tp:
        # K/V pages cross TP sizes as head shards whose count both roles must share; the least
        # common multiple is the smallest count that lies inside one rank of each. (MLA pages
        # ignore it; a model with too few heads for it is refused by the connector at start.)
        extra.setdefault("store_tp_size", math.lcm(prefill_tp, decode_tp))
    if connector == ConnectorName.NIXL:
        kv_role = "kv_both"  # NIXL pulls from either side; vLLM documents kv_both for it
    else:
        kv_role = "kv_producer" if role == Role.PREFILL else "kv_consumer"
    config: dict[str, object] = {
        "kv_connector": str(connector.value), "kv_role": kv_role,
        "kv_load_failure_policy": spec.kv_transfer.load_failure_policy.lower()}
    if connector == ConnectorName.MOONCAKE_STORE:
        # Without the module path, vLLM loads its own connector of the same name. It reads
        # the extra keys used here the same way (save_decode_cache, store_tp_size), and
        # mooncake.json through MOONCAKE_CONFIG_PATH, which every MooncakeStore instance gets.
        config["kv_connector"] = KVHELPER_CONNECTOR_CLASS
        if spec.kv_transfer.implementation == "kvhelper":
            config["kv_connector_module_path"] = KVHELPER_CONNECTOR_MODULE
    if extra:
        config["kv_connector_extra_config"] = extra
    return config


def metadata_server(spec: DisaggServingSpec, etcd_endpoints: tuple[str, ...]) -> str:
    """Where Mooncake's transfer engines find each other's segments."""
    if spec.kv_transfer.mooncake.metadata_backend == "P2PHANDSHAKE":
        return "P2PHANDSHAKE"
    return "etcd://" + ",".join(etcd_endpoints)


def mooncake_config_json(spec: DisaggServingSpec, master: str,
                         etcd_endpoints: tuple[str, ...]) -> str:
    mooncake = spec.kv_transfer.mooncake
    config = {
        "metadata_server": metadata_server(spec, etcd_endpoints),
        "master_server_address": master,
        "protocol": mooncake.protocol,
        "device_name": mooncake.devices,
        # With store pods the pages live there only: an engine that leaves takes none.
        "global_segment_size": 0 if spec.store.replicas
        else parse_quantity(mooncake.global_segment_size),
        "local_buffer_size": parse_quantity(mooncake.local_buffer_size),
    }
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def vllm_args(role: VLLMRole, spec: DisaggServingSpec) -> tuple[str, ...]:
    model = spec.model
    role_spec: RoleSpec = getattr(spec, role)
    args = [
        "python3", "-m", "vllm.entrypoints.openai.api_server",
        "--model", model.name,
        "--host", "0.0.0.0",
        "--port", str(VLLM_PORT),
        "--served-model-name", model.served_model_name or model.name,
        "--dtype", model.dtype,
        "--block-size", str(model.block_size),
        "--tensor-parallel-size", str(role_spec.tensor_parallel_size),
        "--gpu-memory-utilization", str(role_spec.gpu_memory_utilization),
    ]
    if role_spec.data_parallel_size > 1:
        args += ["--data-parallel-size", str(role_spec.data_parallel_size)]
    if role_spec.expert_parallel:
        args.append("--enable-expert-parallel")
    if role_spec.nodes_per_instance > 1:
        # vLLM's multiprocessing multi-node mode: one set of flags for TP and for DP (and EP)
        # across nodes, no Ray. The LeaderWorkerSet controller puts the group's leader address
        # and this pod's index in its environment.
        args += ["--nnodes", str(role_spec.nodes_per_instance),
                 "--node-rank", f"$({LWS_WORKER_INDEX})",
                 "--master-addr", f"$({LWS_LEADER_ADDRESS})",
                 "--master-port", str(MULTI_NODE_PORT)]
    if model.revision:
        args += ["--revision", model.revision]
    if model.trust_remote_code:
        args.append("--trust-remote-code")
    if model.max_model_len:
        args += ["--max-model-len", str(model.max_model_len)]
    if model.kv_cache_dtype != "auto":
        args += ["--kv-cache-dtype", model.kv_cache_dtype]
    args += ["--kv-transfer-config",
             json.dumps(kv_transfer_config(role, spec), sort_keys=True, separators=(",", ":"))]
    args += role_spec.extra_args
    return tuple(args)


def compatibility_labels(spec: DisaggServingSpec) -> dict[str, str]:
    """What prefill and decode must share for KV pages to be interchangeable."""
    labels = {
        "model": spec.model.name,
        "revision": spec.model.revision or "",
        "dtype": spec.model.dtype,
        "blockSize": str(spec.model.block_size),
        "connector": spec.kv_transfer.connector.value,
    }
    if spec.model.kv_cache_dtype != "auto":  # (absent when auto: existing fingerprints stay)
        labels["kvCacheDtype"] = spec.model.kv_cache_dtype
    if spec.kv_transfer.implementation != "kvhelper":  # the two store pages differently
        labels["implementation"] = spec.kv_transfer.implementation
    # Each absent when unset, so that existing fingerprints stay. The image carries vLLM and
    # kvhelper, whose page formats may differ between versions; the connector's own settings
    # may change how pages are laid out or keyed.
    if spec.image:
        labels["image"] = spec.image
    if spec.kv_transfer.extra_config:
        config = json.dumps(spec.kv_transfer.extra_config, sort_keys=True).encode()
        labels["connectorConfig"] = hashlib.sha256(config).hexdigest()[:12]
    return labels


def compatibility_fingerprint(spec: DisaggServingSpec) -> str:
    """Registered by every instance; the proxy pairs only equal ones, so during a rollout that
    changes any of these an old prefill is never paired with a new decode."""
    blob = json.dumps(compatibility_labels(spec), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _vllm_component(role: VLLMRole, spec: DisaggServingSpec,
                    etcd_endpoints: tuple[str, ...], registry_prefix: str,
                    addressing: Addressing,
                    store_env: tuple[tuple[str, EnvValue], ...] = ()) -> Component:
    role_spec: RoleSpec = getattr(spec, role)
    env: list[tuple[str, EnvValue]] = [
        ("POD_IP", PodIP()),
        ("HF_HOME", spec.model.cache.mount_path),
        # vLLM hashes blocks with sha256 by default; a shared seed keeps xxhash (if chosen
        # through extraArgs) identical across instances too.
        ("PYTHONHASHSEED", "0"),
        *store_env,
    ]
    if spec.pod_network.socket_interface:  # the interface NCCL's and Gloo's sockets bind
        env += [("NCCL_SOCKET_IFNAME", spec.pod_network.socket_interface),
                ("GLOO_SOCKET_IFNAME", spec.pod_network.socket_interface)]
    if spec.kv_transfer.connector == ConnectorName.MOONCAKE_STORE:
        # The store's own address comes from POD_IP above (kvhelper.store).
        env.append(("MOONCAKE_CONFIG_PATH", f"{CONFIG_DIR}/{MOONCAKE_CONFIG_FILE}"))
    if (role_spec.nodes_per_instance > 1 or (
            spec.kv_transfer.connector == ConnectorName.MOONCAKE_STORE
            and spec.kv_transfer.implementation == "vllm")):
        # vLLM's own idea of this host's address, which it otherwise guesses from a route to
        # the internet: where the other nodes' ranks reach this one (its message queues), and
        # what vLLM's store connector gives the store.
        env.append(("VLLM_HOST_IP", PodIP()))
    if spec.hf_token_secret is not None:
        env.append(("HF_TOKEN", SecretKey.of(spec.hf_token_secret, "spec.hfTokenSecret")))
    if spec.vllm_api_key_secret is not None:
        env.append(("VLLM_API_KEY",
                    SecretKey.of(spec.vllm_api_key_secret, "spec.vllmApiKeySecret")))
    grace = role_spec.termination_grace_period_seconds
    command = vllm_args(role, spec)
    multi_node = role_spec.nodes_per_instance > 1
    if multi_node:
        # `vllm serve`: the deprecated api_server module ignores --headless (its follower then
        # starts an engine of its own and fails: "collective_rpc should not be called on
        # follower node", seen with vLLM 0.32).
        command = ("vllm", "serve", *command[3:])
    main = Process(name="vllm", command=command, env=tuple(env),
                   ports=(("http", VLLM_PORT),
                          *((("dist", MULTI_NODE_PORT),) if multi_node else ())),
                   health_path="/health", pre_stop=drain_command(grace))
    # The other nodes of a multi-node instance: its remaining ranks, no API server (so no
    # probes and no registrar: the leader is the instance).
    worker = Process(name="vllm", command=(*command, "--headless"),
                     env=tuple(env)) if multi_node else None
    registrar = Process(
        name="registrar",
        command=(
            "python3", "-m", "kvhelper.registry",
            "--role", str(role),
            "--url", addressing.registration_url(),
            "--health-url", f"http://127.0.0.1:{VLLM_PORT}/health",
            "--model", spec.model.served_model_name or spec.model.name,
            "--etcd", ",".join(etcd_endpoints),
            "--prefix", registry_prefix,
            "--fingerprint", compatibility_fingerprint(spec),
        ),
        env=(("POD_IP", PodIP()), *etcd_client_env(spec)),
        startup_check=peer_check_command(role, spec, etcd_endpoints, registry_prefix),
        secret_mounts=etcd_client_mounts(spec),
    )
    cache = spec.model.cache
    compat = ",".join(f"{k}={v}" for k, v in compatibility_labels(spec).items())
    return Component(role=role, replicas=role_spec.replicas, main=main,
                     scaled_externally=spec.autoscaling.mode == "External",
                     nodes=role_spec.nodes_per_instance, worker=worker,
                     sidecars=(registrar,), role_spec=role_spec,
                     reads_config=spec.kv_transfer.connector == ConnectorName.MOONCAKE_STORE,
                     add_capabilities=(("IPC_LOCK",) if spec.kv_transfer.mooncake.protocol
                                       == "rdma" else ()),
                     model_cache=ModelCache(cache.mount_path, cache.pvc_claim_name,
                                            cache.empty_dir_size_limit),
                     annotations=((ANNOTATION_COMPAT, compat), *network_annotations(spec)),
                     stop_grace_seconds=grace, network=pod_network(spec))


def etcd_client_env(spec: DisaggServingSpec) -> tuple[tuple[str, EnvValue], ...]:
    """Where kvhelper's etcd clients find their TLS files (kvhelper.etcd_client)."""
    if spec.etcd.tls is None:
        return ()
    return (("KVHELPER_ETCD_CA_FILE", f"{ETCD_CLIENT_TLS_DIR}/ca.crt"),
            ("KVHELPER_ETCD_CERT_FILE", f"{ETCD_CLIENT_TLS_DIR}/tls.crt"),
            ("KVHELPER_ETCD_KEY_FILE", f"{ETCD_CLIENT_TLS_DIR}/tls.key"))


def etcd_client_mounts(spec: DisaggServingSpec) -> tuple[SecretMount, ...]:
    if spec.etcd.tls is None:
        return ()
    return (SecretMount("etcd-client-tls", spec.etcd.tls.client_secret, ETCD_CLIENT_TLS_DIR,
                        "spec.etcd.tls.clientSecret"),)


def peer_check_command(role: VLLMRole, spec: DisaggServingSpec,
                       etcd_endpoints: tuple[str, ...], registry_prefix: str
                       ) -> tuple[str, ...]:
    """The registrar's startup check: an instance counts as started once the other role has
    an instance of its fingerprint registered. A rollout that changes the fingerprint then
    retires old prefill and decode instances only for new ones that can pair, and never while
    the new revision cannot start in one of the roles (kvhelper.peer_check)."""
    return ("python3", "-m", "kvhelper.peer_check",
            "--peer-role", "decode" if role == Role.PREFILL else "prefill",
            "--fingerprint", compatibility_fingerprint(spec),
            "--etcd", ",".join(etcd_endpoints), "--prefix", registry_prefix)


def drain_command(grace_seconds: int) -> tuple[str, ...]:
    """vLLM's preStop: wait until it has had no request for a few seconds (the registrar has
    withdrawn it from the proxy by then), leaving 10 s of the grace period for vLLM to stop."""
    return ("python3", "-m", "kvhelper.drain", "--url", f"http://127.0.0.1:{VLLM_PORT}",
            "--quiet", "5", "--timeout", str(max(1, grace_seconds - 10)))


def _proxy_component(spec: DisaggServingSpec, etcd_endpoints: tuple[str, ...],
                     registry_prefix: str, has_store_config: bool,
                     store_env: tuple[tuple[str, EnvValue], ...] = ()) -> Component:
    port = spec.proxy.service.port
    # Keys reach the proxy only through its environment, from Secrets (kvhelper.proxy).
    env: list[tuple[str, EnvValue]] = []
    routing_args: tuple[str, ...] = ()
    routes_on_store = store_routing(spec) and has_store_config
    if routes_on_store:
        # The proxy tokenizes and hashes prompts exactly as the instances do: the model's
        # tokenizer, and their PYTHONHASHSEED (see _vllm_component).
        model = spec.model
        routing_args = ("--store-routing", "--tokenizer", model.name,
                        *(("--tokenizer-revision", model.revision) if model.revision else ()),
                        *(("--trust-remote-code",) if model.trust_remote_code else ()),
                        "--mooncake-config", f"{CONFIG_DIR}/{MOONCAKE_CONFIG_FILE}",
                        *(("--local-prefill-tokens", str(spec.proxy.local_prefill_tokens))
                          if spec.proxy.local_prefill_tokens else ()))
        env += [("POD_IP", PodIP()), ("PYTHONHASHSEED", "0"), ("HF_HOME", PROXY_CACHE_DIR),
                *store_env]
        if spec.hf_token_secret is not None:
            env.append(("HF_TOKEN", SecretKey.of(spec.hf_token_secret, "spec.hfTokenSecret")))
    if spec.proxy.api_key_secret is not None:
        env.append(("DISAGG_PROXY_API_KEY",
                    SecretKey.of(spec.proxy.api_key_secret, "spec.proxy.apiKeySecret")))
    if spec.vllm_api_key_secret is not None:
        env.append(("DISAGG_PROXY_BACKEND_API_KEY",
                    SecretKey.of(spec.vllm_api_key_secret, "spec.vllmApiKeySecret")))
    main = Process(
        name="proxy",
        command=("python3", "-m", "kvhelper.proxy",
                 "--host", "0.0.0.0", "--port", str(port),
                 "--routing", spec.proxy.routing,
                 "--etcd", ",".join(etcd_endpoints),
                 "--prefix", registry_prefix, *routing_args),
        env=(*env, *etcd_client_env(spec)),
        ports=(("http", port),),
        health_path="/health",
        secret_mounts=etcd_client_mounts(spec),
    )
    cache = spec.model.cache
    return Component(role=Role.PROXY, replicas=spec.proxy.replicas, main=main,
                     reads_config=routes_on_store,
                     model_claim=(ModelCache(cache.mount_path, cache.pvc_claim_name, None)
                                  if routes_on_store and cache.pvc_claim_name else None),
                     cache_dir=PROXY_CACHE_DIR if routes_on_store else None,
                     resources=spec.proxy.resources, service_type=spec.proxy.service.type)


def _mooncake_master_component(spec: DisaggServingSpec, etcd_endpoints: tuple[str, ...],
                               store_env: tuple[tuple[str, EnvValue], ...]) -> Component:
    master = spec.mooncake_master
    common = (f"--rpc_port={master.port}",
              f"--metrics_port={master.metrics_port}",
              f"--client_ttl={master.client_ttl_seconds}",
              f"--eviction_high_watermark_ratio={master.eviction.high_watermark_ratio}",
              f"--eviction_ratio={master.eviction.ratio}")
    if master.replicas == 1:
        # One master: Mooncake keeps objects in the master's memory, and two independent
        # ones would split the store.
        main = Process(name="mooncake-master",
                       command=("mooncake_master", "--rpc_address=0.0.0.0", *common),
                       ports=(("rpc", master.port), ("metrics", master.metrics_port)),
                       health_path=None)
        return Component(role=Role.MOONCAKE_MASTER, replicas=1, main=main,
                         resources=master.resources)
    # HA: every master campaigns in etcd; the leader serves at the address it registers
    # (its pod's), the others stand by. Ready means running, leader or not: the admin port's
    # /health answers for both (the RPC port opens on the leader only).
    cluster_id = dict(store_env)["MC_STORE_CLUSTER_ID"]
    main = Process(name="mooncake-master",
                   command=("mooncake_master", "--enable_ha=true",
                            f"--etcd_endpoints={';'.join(etcd_endpoints)}",
                            f"--cluster_id={cluster_id}", "--rpc_address=$(POD_IP)", *common),
                   env=(("POD_IP", PodIP()),),
                   ports=(("metrics", master.metrics_port), ("rpc", master.port)),
                   health_path="/health")
    return Component(role=Role.MOONCAKE_MASTER, replicas=master.replicas, main=main,
                     resources=master.resources)


def _store_component(spec: DisaggServingSpec, master: str, etcd_endpoints: tuple[str, ...],
                     store_env: tuple[tuple[str, EnvValue], ...] = ()) -> Component:
    """Mooncake's standalone store client: it mounts its segment with the master and serves
    transfers from it, so the pool outlives every vLLM instance."""
    mooncake = spec.kv_transfer.mooncake
    main = Process(
        name="mooncake-store",
        command=("mooncake_client",
                 f"--master_server_address={master}",
                 f"--metadata_server={metadata_server(spec, etcd_endpoints)}",
                 f"--global_segment_size={parse_quantity(spec.store.segment_size)}",
                 f"--protocol={mooncake.protocol}",
                 f"--device_names={mooncake.devices}",
                 "--host=$(POD_IP)",
                 f"--port={STORE_RPC_PORT}",
                 "--enable_http_server=true",
                 f"--http_port={STORE_HTTP_PORT}"),
        env=(("POD_IP", PodIP()), *store_env),
        ports=(("http", STORE_HTTP_PORT), ("rpc", STORE_RPC_PORT)),
        health_path="/health",
    )
    segment_mib = -(-parse_quantity(spec.store.segment_size) // (1 << 20))
    # The segment is ordinary process memory (not /dev/shm), held for the pod's life.
    memory = f"{segment_mib + 512}Mi"
    return Component(role=Role.STORE, replicas=spec.store.replicas, main=main,
                     annotations=network_annotations(spec), network=pod_network(spec),
                     resources=spec.store.resources or {
                         "requests": {"cpu": "500m", "memory": memory},
                         "limits": {"memory": memory}},
                     add_capabilities=("IPC_LOCK",) if mooncake.protocol == "rdma" else ())


def _etcd_component(name: str, spec: DisaggServingSpec) -> Component:
    peer_service = child_name(name, ETCD)
    tls = spec.etcd.tls
    client_scheme = "https" if tls else "http"
    tls_args: tuple[str, ...] = ()
    ports: tuple[tuple[str, int], ...] = (("client", ETCD_CLIENT_PORT), ("peer", ETCD_PEER_PORT))
    if tls is not None:
        # Clients present a certificate the Secret's CA signed. /health and /metrics move to
        # a plain HTTP listener of their own, for the kubelet's probes and the operator.
        tls_args = (f"--cert-file={ETCD_SERVER_TLS_DIR}/tls.crt",
                    f"--key-file={ETCD_SERVER_TLS_DIR}/tls.key",
                    f"--trusted-ca-file={ETCD_SERVER_TLS_DIR}/ca.crt", "--client-cert-auth",
                    f"--listen-metrics-urls=http://0.0.0.0:{ETCD_METRICS_PORT}")
        ports = (*ports, ("metrics", ETCD_METRICS_PORT))
    main = Process(
        name="etcd",
        command=(
            "etcd",
            "--name=$(POD_NAME)",
            "--data-dir=/var/lib/etcd",
            f"--listen-client-urls={client_scheme}://0.0.0.0:{ETCD_CLIENT_PORT}",
            f"--advertise-client-urls={client_scheme}://$(POD_NAME).{peer_service}:"
            f"{ETCD_CLIENT_PORT}",
            f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT}",
            f"--initial-advertise-peer-urls=http://$(POD_NAME).{peer_service}:{ETCD_PEER_PORT}",
            f"--initial-cluster=$(POD_NAME)=http://$(POD_NAME).{peer_service}:{ETCD_PEER_PORT}",
            "--initial-cluster-state=new",
            *tls_args,
        ),
        env=(("POD_NAME", PodName()),),
        ports=ports,
        health_path="/health",
        health_port="metrics" if tls else None,
        secret_mounts=((SecretMount("etcd-server-tls", tls.server_secret, ETCD_SERVER_TLS_DIR,
                                    "spec.etcd.tls.serverSecret"),)
                       if tls is not None and tls.server_secret else ()),
    )
    etcd = spec.etcd
    return Component(role=Role.ETCD, replicas=1, main=main, resources=etcd.resources,
                     image=etcd.image, storage_size=etcd.storage_size)
