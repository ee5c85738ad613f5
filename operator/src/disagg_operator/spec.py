"""The DisaggServing spec as typed models: the single source of the CRD schema and its defaults.

`crd.py` turns these models into the CRD's structural OpenAPI schema, so a default or a
constraint written here is what the API server applies too. Cross-field rules that the API
server enforces with CEL are declared next to the model they constrain (`cel_rules`) and are
also checked here, so an API server without CEL (or the emulator) cannot let them through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

from disagg_operator import association
from disagg_operator.quantity import parse_quantity

GROUP, VERSION, KIND = association.GROUP, association.VERSION, association.KIND
PLURAL = "disaggservings"
SINGULAR = "disaggserving"
SHORT_NAMES = ["dsv"]
# Child names append a suffix and must stay DNS labels (disagg_operator.association).
MAX_NAME_LENGTH = association.MAX_NAME_LENGTH



class CelRule(BaseModel):
    """One `x-kubernetes-validations` entry: the API server rejects objects failing `rule`."""

    rule: str
    message: str
    field_path: str | None = None


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        frozen=True,
    )
    # CEL rules attached to this object's schema; mirrored by a model_validator.
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()


def _obj(description: str) -> Any:
    """A nested object that defaults to `{}` so that its own defaults apply."""
    return Field(default=None, description=description, json_schema_extra={"default": {}})


# Kubernetes types that we pass through unchanged; the API server validates them in the workload.
_K8S_OBJECT: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
_K8S_LIST: dict[str, Any] = {"type": "array", "items": _K8S_OBJECT}


def _passthrough(description: str, schema: dict[str, Any]) -> Any:
    return Field(default=None, description=description,
                 json_schema_extra={"x-k8s-schema": schema})


class ConnectorName(StrEnum):
    MOONCAKE_STORE = "MooncakeStore"
    P2P_NCCL = "P2pNcclConnector"
    NIXL = "NixlConnector"
    MOONCAKE = "MooncakeConnector"


class ModelCacheSpec(_Model):
    """Where model weights are cached in the vLLM pods (HF_HOME)."""

    pvc_claim_name: str | None = Field(
        default=None, alias="pvcClaimName",
        description="Existing PersistentVolumeClaim to cache weights in (shared ReadWriteMany "
                    "or ReadOnlyMany). Default: an emptyDir per pod.")
    empty_dir_size_limit: str | int | None = Field(
        default=None, alias="emptyDirSizeLimit",
        description="sizeLimit of the per-pod emptyDir when no PVC is given, e.g. 100Gi.",
        json_schema_extra={"x-kubernetes-int-or-string": True})
    mount_path: str = Field(default="/models", description="Mount path of the cache; HF_HOME.")

    cel_rules = (CelRule(
        rule="!(has(self.pvcClaimName) && has(self.emptyDirSizeLimit))",
        message="set either model.cache.pvcClaimName or model.cache.emptyDirSizeLimit, not both"),)

    @model_validator(mode="after")
    def _one_source(self) -> ModelCacheSpec:
        if self.pvc_claim_name and self.empty_dir_size_limit:
            raise ValueError(self.cel_rules[0].message)
        return self


class ModelSpec(_Model):
    name: str = Field(min_length=1, description="Hugging Face model id or a path in the image.")
    served_model_name: str | None = Field(
        default=None, description="Name clients use; default: model.name.")
    revision: str | None = Field(default=None, description="Model revision (branch, tag, commit).")
    trust_remote_code: bool = Field(default=False, description="Pass --trust-remote-code.")
    max_model_len: int | None = Field(default=None, ge=1, description="Context length limit.")
    dtype: Literal["auto", "half", "float16", "bfloat16", "float", "float32"] = Field(
        default="auto", description="Weights and activations dtype, same for prefill and decode.")
    # The block sizes vLLM's CacheConfig accepts (tokens per KV page).
    block_size: Literal[1, 8, 16, 32, 64, 128, 256] = Field(
        default=16, description="KV page size in tokens; prefill and decode always share it.")
    kv_heads: int | None = Field(
        default=None, ge=1, description="The model's K/V heads (num_key_value_heads in its "
        "config): lets the operator check the TP sizes and store_tp_size before any pod "
        "starts. MLA models (DeepSeek, Kimi) have one latent head, the same on every rank: "
        "set 1. Unset, the check waits for the pods' start, and the ConfigWarning condition "
        "says so.")
    kv_cache_dtype: Literal["auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2",
                            "fp8_ds_mla"] = Field(
        default="auto", description="KV cache dtype (vLLM's --kv-cache-dtype), the same on "
        "prefill and decode so that their pages are interchangeable; auto: the model dtype.")
    cache: ModelCacheSpec = _obj("Weight cache volume.")

    @model_validator(mode="before")
    @classmethod
    def _default_objects(cls, data: Any) -> Any:
        return _fill_object_defaults(cls, data)


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, description="Secret name in the DisaggServing's namespace.")
    key: str = Field(default="token", min_length=1, description="Key inside the Secret.")


class LocalObjectReference(_Model):
    name: str = Field(min_length=1, description="Name of an object in the same namespace.")


class MooncakeSpec(_Model):
    protocol: Literal["tcp", "rdma"] = Field(default="tcp", description="Transfer protocol.")
    global_segment_size: str | int = Field(
        default="4Gi", description="Memory each vLLM pod contributes to the store.",
        json_schema_extra={"x-kubernetes-int-or-string": True})
    local_buffer_size: str | int = Field(
        default="1Gi", description="Per-pod registered transfer buffer.",
        json_schema_extra={"x-kubernetes-int-or-string": True})
    devices: str = Field(default="", description="RDMA devices, e.g. mlx5_0,mlx5_1 (rdma only).")
    rdma_resource: str | None = Field(
        default=None, description="The extended resource that gives a pod its RDMA devices, "
        "e.g. the RDMA shared device plugin's; every vLLM and store pod requests one when "
        "protocol is rdma.")
    metadata_backend: Literal["etcd", "P2PHANDSHAKE"] = Field(
        default="etcd", description="Transfer-engine metadata: the DisaggServing's etcd, or "
                                    "peer-to-peer handshakes (no metadata server).")

    @model_validator(mode="after")
    def _sizes_parse(self) -> MooncakeSpec:
        for field, value in (("globalSegmentSize", self.global_segment_size),
                             ("localBufferSize", self.local_buffer_size)):
            try:
                if parse_quantity(value) <= 0:
                    raise ValueError("must be positive")
            except ValueError as err:
                raise ValueError(
                    f"kvTransfer.mooncake.{field}={value!r} is not a positive size "
                    f"(use a Kubernetes quantity such as 4Gi): {err}") from None
        return self


class KVTransferSpec(_Model):
    connector: ConnectorName = Field(
        default=ConnectorName.MOONCAKE_STORE,
        description="MooncakeStore is the kvhelper connector; the others are vLLM's own, "
                    "passed through unchanged.")
    implementation: Literal["kvhelper", "vllm"] = Field(
        default="kvhelper", description="Which MooncakeStore connector the instances run: "
        "kvhelper (this project's: MLA pages stored once, store-aware routing) or vllm "
        "(vLLM's built-in MooncakeStoreConnector, with its own prefix lookups; the proxy "
        "then routes without the store).")
    mooncake: MooncakeSpec = _obj("Mooncake store settings (MooncakeStore connector).")
    load_failure_policy: Literal["Recompute", "Fail"] = Field(
        default="Recompute", description="When decode cannot load a request's KV (evicted, "
        "store restarted): recompute the prompt, or fail the request.")
    save_decode_cache: bool = Field(
        default=False, description="Decode instances store the KV of prompt and generated "
        "tokens when a request finishes, so a conversation's next turn finds its whole "
        "history in the store (MooncakeStore; costs a store write per request).")
    extra_config: dict[str, Any] = Field(
        default_factory=dict, description="Merged into kv_connector_extra_config.",
        json_schema_extra={"x-k8s-schema": _K8S_OBJECT})

    @model_validator(mode="before")
    @classmethod
    def _default_objects(cls, data: Any) -> Any:
        return _fill_object_defaults(cls, data)


# vLLM flags the operator renders itself, so prefill and decode cannot disagree on them.
MANAGED_VLLM_FLAGS = {
    "--model": "spec.model.name", "--served-model-name": "spec.model.servedModelName",
    "--revision": "spec.model.revision", "--dtype": "spec.model.dtype",
    "--block-size": "spec.model.blockSize", "--max-model-len": "spec.model.maxModelLen",
    "--kv-cache-dtype": "spec.model.kvCacheDtype",
    "--trust-remote-code": "spec.model.trustRemoteCode",
    "--tensor-parallel-size": "tensorParallelSize", "-tp": "tensorParallelSize",
    "--data-parallel-size": "dataParallelSize", "-dp": "dataParallelSize",
    "--enable-expert-parallel": "expertParallel", "-ep": "expertParallel",
    "--nnodes": "nodesPerInstance", "--node-rank": "nodesPerInstance",
    "--master-addr": "nodesPerInstance", "--master-port": "nodesPerInstance",
    "--headless": "nodesPerInstance",
    "--gpu-memory-utilization": "gpuMemoryUtilization",
    "--kv-transfer-config": "spec.kvTransfer", "--host": "the pod (fixed)",
    "--port": "the pod (fixed)",
}
# vLLM flags the serving pods cannot honour, and why.
UNSUPPORTED_VLLM_FLAGS = dict.fromkeys(
    ("--pipeline-parallel-size", "-pp"),
    "the kvhelper connector keys KV pages by block and TP rank, and pipeline stages hold "
    "different layers, so they would overwrite each other's pages; use tensorParallelSize")


# Far above any deployment of vLLM instances, far below the API server's int32: a typo
# (an extra digit or nine) is refused here, naming the field, not by the Deployment.
MAX_REPLICAS = 1000


class TopologyAffinitySpec(_Model):
    topology_key: str = Field(min_length=1, description="The node label of the domain, e.g. "
                              "topology.kubernetes.io/zone or a rack label.")
    required: bool = Field(default=False, description="Required (the pod waits for a domain "
                           "with a prefill pod) rather than preferred.")


class RoleSpec(_Model):
    """A vLLM role (prefill or decode)."""

    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="Number of vLLM instances.")
    tensor_parallel_size: int = Field(default=1, ge=1, le=64,
                                      description="Tensor-parallel ranks per data-parallel rank.")
    data_parallel_size: int = Field(
        default=1, ge=1, le=256, description="Data-parallel ranks of one instance, each with "
        "its own scheduler and KV cache (vLLM balances requests across them).")
    expert_parallel: bool = Field(
        default=False, description="Spread MoE experts over the instance's TP x DP ranks "
        "(vLLM's --enable-expert-parallel), as wide-EP DeepSeek and Kimi deployments do.")
    nodes_per_instance: int = Field(
        default=1, ge=1, le=64, description="Nodes one instance spans. Above 1 each instance "
        "is a LeaderWorkerSet group of this many pods (the LeaderWorkerSet controller must "
        "be installed): the leader runs the API server, the others its remaining ranks.")
    gpus_per_node: int | None = Field(
        default=None, ge=1, le=64, description="GPUs per pod; default: TP x DP / "
        "nodesPerInstance. Given, it must equal that (a check of the sizes).")
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="Share of the GPU memory vLLM may use "
        "(--gpu-memory-utilization); the KV cache gets what the weights leave of it.")
    resources: dict[str, Any] | None = _passthrough(
        "Container resources; default: nvidia.com/gpu = tensorParallelSize.", _K8S_OBJECT)
    node_selector: dict[str, str] | None = Field(
        default=None, description="Pod nodeSelector: labels the nodes must have.")
    tolerations: list[dict[str, Any]] | None = _passthrough("Pod tolerations.", _K8S_LIST)
    affinity: dict[str, Any] | None = _passthrough("Pod affinity.", _K8S_OBJECT)
    env: list[dict[str, Any]] | None = _passthrough("Extra container env vars.", _K8S_LIST)
    extra_args: list[str] = Field(default_factory=list, description="Extra vLLM CLI arguments.")
    termination_grace_period_seconds: int = Field(
        default=300, ge=30, le=86400,
        description="How long a leaving instance may take: it leaves the registry at once, "
                    "then finishes the requests it has (its preStop waits until it has had "
                    "none for 5 s, up to this minus 10 s) before vLLM is stopped.")
    shared_memory_size: str | int | None = Field(
        default=None, description="sizeLimit of the vLLM pods' memory-backed /dev/shm (NCCL "
        "and vLLM's workers use it across processes); default: no limit but the pod's memory.",
        json_schema_extra={"x-kubernetes-int-or-string": True})
    exclusive_topology: str | None = Field(
        default=None, description="A node label (e.g. a rack or NVLink-domain label): at most "
        "one instance group per domain (the LeaderWorkerSet's exclusive placement; "
        "nodesPerInstance above 1 only).")
    affinity_to_prefill: TopologyAffinitySpec | None = Field(
        default=None, description="decode only: keep each decode pod in a topology domain "
        "that holds a prefill pod of this DisaggServing (KV moves within the domain).")
    pod_template: dict[str, Any] | None = _passthrough(
        "A partial PodTemplateSpec merged over the rendered one (containers merged by name): "
        "schedulerName, gang-scheduling labels and annotations (Volcano, Kueue, "
        "scheduler-plugins coscheduling), anything else the pods need.",
        _K8S_OBJECT)

    @field_validator("extra_args")
    @classmethod
    def _no_managed_flags(cls, args: list[str]) -> list[str]:
        for arg in args:
            flag = arg.split("=", 1)[0].replace("_", "-")
            if flag in MANAGED_VLLM_FLAGS:
                raise ValueError(
                    f"{flag} is set by the operator from {MANAGED_VLLM_FLAGS[flag]}; "
                    "set it there instead of in extraArgs")
            if flag in UNSUPPORTED_VLLM_FLAGS:
                raise ValueError(f"{flag} is not supported: {UNSUPPORTED_VLLM_FLAGS[flag]}")
        return args


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        default="ClusterIP", description="Kubernetes Service type.")
    port: int = Field(default=8000, ge=1, le=65535, description="Port clients connect to.")


class ProxySpec(_Model):
    replicas: int = Field(default=1, ge=0, le=MAX_REPLICAS, description="Proxy instances; "
                          "each discovers every prefill and decode instance by itself.")
    api_key_secret: SecretKeyRef | None = Field(
        default=None, description="Secret holding the API key clients must present to the "
        "proxy (Authorization: Bearer ...); default: none.")
    routing: Literal["round-robin", "least-outstanding"] = Field(
        default="round-robin", description="How each phase picks an instance.")
    store_routing: bool | None = Field(
        default=None, description="Route on what the Mooncake store holds: a prompt stored in "
        "full goes straight to decode (no prefill), others to the prefill instance with the "
        "least work. The proxy loads the model's tokenizer for it. Default: on with the "
        "MooncakeStore connector and kvTransfer.loadFailurePolicy Recompute.")
    local_prefill_tokens: int = Field(
        default=0, ge=0, description="With storeRouting: a prompt with at most this many "
        "tokens beyond the prefix the store holds also skips prefill; decode loads the "
        "prefix and computes the rest itself (sooner than a prefill instance would take the "
        "request, but on decode's time). 0: only prompts stored in full.")
    service: ServiceSpec = _obj("The client-facing Service.")
    resources: dict[str, Any] | None = _passthrough("Proxy container resources.", _K8S_OBJECT)

    @model_validator(mode="before")
    @classmethod
    def _default_objects(cls, data: Any) -> Any:
        return _fill_object_defaults(cls, data)


class EtcdTlsSpec(_Model):
    """Client TLS to the DisaggServing's etcd: Secrets in cert-manager's layout (ca.crt,
    tls.crt, tls.key), mounted where they are used and never read by the operator."""

    client_secret: str = Field(
        min_length=1, description="Secret with the CA that signed etcd's serving certificate "
        "and the client certificate that registrars and the proxy present (etcd runs with "
        "--client-cert-auth).")
    server_secret: str | None = Field(
        default=None, description="Managed etcd only (required there): the serving "
        "certificate, valid for NAME-etcd-client.NAMESPACE.svc and its cluster domain form, "
        "with the CA that signed the client certificates.")


class EtcdSpec(_Model):
    mode: Literal["Managed", "External"] = Field(
        default="Managed", description="Managed: the operator runs etcd; External: use endpoints.")
    endpoints: list[str] = Field(
        default_factory=list, description="host:port of an external etcd (mode External).")
    image: str = Field(default="quay.io/coreos/etcd:v3.5.17", description="Managed etcd image.")
    storage_size: str | int | None = Field(
        default=None, description="Managed etcd data PVC size; default: an emptyDir.",
        json_schema_extra={"x-kubernetes-int-or-string": True})
    resources: dict[str, Any] | None = _passthrough("Managed etcd resources.", _K8S_OBJECT)
    tls: EtcdTlsSpec | None = Field(
        default=None, description="Client TLS (off when unset). Mooncake's etcd client takes "
        "no TLS settings: with TLS, use kvTransfer.mooncake.metadataBackend P2PHANDSHAKE and "
        "one Mooncake master.")

    cel_rules = (CelRule(
        rule="self.mode != 'External' || size(self.endpoints) > 0",
        message="etcd.endpoints must list at least one host:port when etcd.mode is External",
        field_path=".endpoints"),)

    @model_validator(mode="after")
    def _external_needs_endpoints(self) -> EtcdSpec:
        if self.mode == "External" and not self.endpoints:
            raise ValueError(self.cel_rules[0].message)
        return self


class EvictionSpec(_Model):
    high_watermark_ratio: float = Field(
        default=0.95, gt=0, le=1, description="Store usage that starts eviction.")
    ratio: float = Field(default=0.05, gt=0, le=1, description="Share evicted per round.")


class MooncakeMasterSpec(_Model):
    replicas: int = Field(
        default=1, ge=1, le=5, description="Masters. Above 1: Mooncake's HA mode, with a "
        "leader elected through the DisaggServing's etcd that the clients follow. Objects "
        "the old leader knew are lost on a change of leader (the pages are recomputed).")
    port: int = Field(default=50051, ge=1, le=65535, description="RPC port.")
    metrics_port: int = Field(default=9003, ge=1, le=65535,
                              description="HTTP port of the master's /metrics and /health.")
    client_ttl_seconds: int = Field(
        default=10, ge=1, description="A dead client's segment is dropped after this.")
    eviction: EvictionSpec = _obj("Store eviction.")
    resources: dict[str, Any] | None = _passthrough("Master container resources.", _K8S_OBJECT)

    cel_rules = (CelRule(rule="self.port != self.metricsPort",
                         message="mooncakeMaster.port and metricsPort must differ"),)

    @model_validator(mode="before")
    @classmethod
    def _default_objects(cls, data: Any) -> Any:
        return _fill_object_defaults(cls, data)

    @model_validator(mode="after")
    def _ports_differ(self) -> MooncakeMasterSpec:
        if self.port == self.metrics_port:
            raise ValueError(self.cel_rules[0].message)
        return self


class PodNetworkSpec(_Model):
    """How the vLLM and store pods reach each other's nodes."""

    host_network: bool = Field(
        default=False, description="Run vLLM and store pods in the node's network namespace "
        "(some RDMA setups need it; ports must then be free on the node).")
    annotations: dict[str, str] | None = Field(
        default=None, description="Added to vLLM and store pods, e.g. "
        "k8s.v1.cni.cncf.io/networks for a secondary (RDMA) network.")
    socket_interface: str | None = Field(
        default=None, description="The interface NCCL and Gloo bind (NCCL_SOCKET_IFNAME, "
        "GLOO_SOCKET_IFNAME) on vLLM pods, e.g. eth0.")


class NetworkPolicySpec(_Model):
    """Which pods may reach the DisaggServing's pods: ingress NetworkPolicies per component.
    Egress is left open (DNS, model downloads)."""

    enabled: bool = Field(
        default=True, description="Render the NetworkPolicies (the cluster's network plugin "
        "must enforce them).")
    clients_from: list[dict[str, Any]] | None = _passthrough(
        "NetworkPolicy peers that may reach the proxy's port (the clients); default: any "
        "source.", _K8S_LIST)
    metrics_from: list[dict[str, Any]] | None = _passthrough(
        "NetworkPolicy peers that may scrape the metrics ports (e.g. a namespaceSelector "
        "matching your Prometheus's namespace); default: only the operator.", _K8S_LIST)


class StoreSpec(_Model):
    """Pods that only hold KV pages: Mooncake's standalone store client (`mooncake_client`),
    each contributing `segmentSize` of memory to the store's pool."""

    replicas: int = Field(
        default=0, ge=0, le=MAX_REPLICAS, description="Store pods. 0: every vLLM pod contributes "
        "kvTransfer.mooncake.globalSegmentSize to the pool, and an instance that leaves "
        "(scale-down, rollout) takes the pages placed in it. Above 0: the pages live in these "
        "pods only (vLLM pods contribute none), so scaling and rollouts keep the cache.")
    segment_size: str | int = Field(
        default="16Gi", description="Memory each store pod contributes to the pool.",
        json_schema_extra={"x-kubernetes-int-or-string": True})
    resources: dict[str, Any] | None = _passthrough(
        "Store container resources; default: segmentSize plus 512Mi of memory, requested and "
        "limited.", _K8S_OBJECT)

    @model_validator(mode="after")
    def _size_parses(self) -> StoreSpec:
        try:
            if parse_quantity(self.segment_size) <= 0:
                raise ValueError("must be positive")
        except ValueError as err:
            raise ValueError(f"store.segmentSize={self.segment_size!r} is not a positive size "
                             f"(use a Kubernetes quantity such as 64Gi): {err}") from None
        return self


class PrefillProfileSpec(_Model):
    """A prefill instance's step time: base + perToken * tokens + perTokenContext * tokens *
    context + perContextToken * context (the simulator's profile file, `prefill:` section, in
    these units)."""

    base_seconds: float = Field(ge=0, description="Fixed time of one prefill step.")
    per_token_seconds: float = Field(gt=0, description="Time per prompt token computed.")
    per_token_context_seconds: float = Field(
        default=0.0, ge=0, description="Attention time per token and token of context.")
    per_context_token_seconds: float = Field(
        default=0.0, ge=0, description="Time per token of context a step reads again (MLA "
        "expands its cached latent for every step; 0 for GQA).")
    max_batched_tokens: int = Field(
        default=8192, ge=1, description="vLLM's token budget per step (max_num_batched_tokens).")


class DecodeProfileSpec(_Model):
    """A decode instance's step time: base + perSequence * running + perContextToken * the
    running sequences' summed context (the profile file's `decode:` section)."""

    base_seconds: float = Field(ge=0, description="Fixed time of one decode step.")
    per_sequence_seconds: float = Field(ge=0, description="Time per running sequence.")
    per_context_token_seconds: float = Field(
        ge=0, description="Time per token of the running sequences' context.")
    max_sequences: int = Field(default=256, ge=1, description="vLLM's max_num_seqs.")
    kv_capacity_tokens: int = Field(ge=1, description="KV cache tokens one instance holds.")


class PerformanceProfileSpec(_Model):
    prefill: PrefillProfileSpec
    decode: DecodeProfileSpec


class ReplicaBoundsSpec(_Model):
    min_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS,
                              description="Fewest instances the planner keeps.")
    max_replicas: int = Field(default=8, ge=1, le=MAX_REPLICAS,
                              description="Most instances the planner asks for.")

    cel_rules = (CelRule(rule="self.minReplicas <= self.maxReplicas",
                         message="minReplicas must not exceed maxReplicas"),)

    @model_validator(mode="after")
    def _ordered(self) -> ReplicaBoundsSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"{self.cel_rules[0].message} ({self.min_replicas} > "
                             f"{self.max_replicas})")
        return self


class AutoscalingSpec(_Model):
    """Who sets the prefill and decode replica counts."""

    mode: Literal["Off", "Planner", "External"] = Field(
        default="Off", description="Off: spec.prefill.replicas and spec.decode.replicas. "
        "Planner: the operator sizes both roles every intervalSeconds from the serving pods' "
        "metrics, the profile and the latency targets (the spec's replicas are the starting "
        "counts). External: the operator leaves each role's Deployment replicas to whatever "
        "scales its /scale subresource (HPA, KEDA); it creates them with one.")
    ttft_p90_seconds: float | None = Field(
        default=None, gt=0, description="Target 90th-percentile time to first token (Planner).")
    itl_p90_seconds: float | None = Field(
        default=None, gt=0, description="Target 90th-percentile inter-token latency (Planner).")
    interval_seconds: int = Field(
        default=180, ge=10, le=3600, description="How often the planner decides; its load and "
        "latencies are measured over the interval before.")
    scale_down_stabilization_seconds: int = Field(
        default=300, ge=0, le=86400, description="A role shrinks only to the highest count "
        "recommended within this long (scale-ups are immediate).")
    scale_down_step: int = Field(
        default=1, ge=1, description="Most instances of one role removed per decision.")
    prefill: ReplicaBoundsSpec = _obj("Bounds on prefill instances (Planner).")
    decode: ReplicaBoundsSpec = _obj("Bounds on decode instances (Planner).")
    min_prefill_per_decode: float | None = Field(
        default=None, gt=0, description="Keep prefill/decode at least this (Planner).")
    max_prefill_per_decode: float | None = Field(
        default=None, gt=0, description="Keep prefill/decode at most this (Planner).")
    profile: PerformanceProfileSpec | None = Field(
        default=None, description="How fast one instance of each role is (Planner): the "
        "prefill and decode sections of a simulator profile (simulator/profiling fits them).")

    cel_rules = (
        CelRule(rule="self.mode != 'Planner' || (has(self.ttftP90Seconds) && "
                     "has(self.itlP90Seconds) && has(self.profile))",
                message="autoscaling.mode Planner needs ttftP90Seconds, itlP90Seconds and "
                        "profile"),
        CelRule(rule="!has(self.minPrefillPerDecode) || !has(self.maxPrefillPerDecode) || "
                     "self.minPrefillPerDecode <= self.maxPrefillPerDecode",
                message="minPrefillPerDecode must not exceed maxPrefillPerDecode"),
    )

    @model_validator(mode="before")
    @classmethod
    def _default_objects(cls, data: Any) -> Any:
        return _fill_object_defaults(cls, data)

    @model_validator(mode="after")
    def _planner_inputs(self) -> AutoscalingSpec:
        if self.mode == "Planner":
            missing = [name for name, value in (
                ("ttftP90Seconds", self.ttft_p90_seconds),
                ("itlP90Seconds", self.itl_p90_seconds), ("profile", self.profile))
                if value is None]
            if missing:
                raise ValueError(f"mode Planner needs {', '.join(missing)}: set them, or "
                                 "mode Off to keep the spec's replica counts")
        if (self.min_prefill_per_decode is not None and self.max_prefill_per_decode is not None
                and self.min_prefill_per_decode > self.max_prefill_per_decode):
            raise ValueError(self.cel_rules[1].message)
        return self


class DisaggServingSpec(_Model):
    model: ModelSpec = Field(description="The model both roles serve.")
    image: str | None = Field(
        default=None, description="Serving image (vLLM + kvhelper); default: the operator's.")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="Pull policy of the serving image.")
    image_pull_secrets: list[LocalObjectReference] = Field(
        default_factory=list, description="Secrets for pulling the serving image.")
    hf_token_secret: SecretKeyRef | None = Field(
        default=None, description="Secret holding a Hugging Face token (exposed as HF_TOKEN).")
    vllm_api_key_secret: SecretKeyRef | None = Field(
        default=None, description="Secret holding the API key vLLM instances require "
        "(VLLM_API_KEY); the proxy presents it to them.")
    kv_transfer: KVTransferSpec = _obj("How KV moves from prefill to decode.")
    prefill: RoleSpec = _obj("Prefill instances (kv_producer).")
    decode: RoleSpec = _obj("Decode instances (kv_consumer).")
    proxy: ProxySpec = _obj("The XpYd proxy: the client entry point.")
    etcd: EtcdSpec = _obj("Metadata and registry store.")
    mooncake_master: MooncakeMasterSpec = _obj("The Mooncake store master (MooncakeStore).")
    store: StoreSpec = _obj("Dedicated pods holding the store's memory (MooncakeStore).")
    network_policy: NetworkPolicySpec = _obj("Which pods may reach the serving pods.")
    pod_network: PodNetworkSpec = _obj("Host network, secondary networks and interfaces.")
    autoscaling: AutoscalingSpec = _obj("Who sets the prefill and decode replica counts.")

    @model_validator(mode="before")
    @classmethod
    def _default_objects(cls, data: Any) -> Any:
        return _fill_object_defaults(cls, data)


def _fill_object_defaults(cls: type[BaseModel], data: Any) -> Any:
    """Apply `default: {}` to absent nested objects, as the API server's defaulting does."""
    if not isinstance(data, dict):
        return data
    filled = dict(data)
    for name, field in cls.model_fields.items():
        extra = field.json_schema_extra
        key = field.alias or name
        if isinstance(extra, dict) and extra.get("default") == {} and filled.get(key) is None \
                and filled.get(name) is None:
            filled[key] = {}
    return filled


class InvalidSpecError(ValueError):
    """The spec cannot be served; `field` names where, `message` says what to change."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"spec.{field}: {message}" if field else message)
        self.field = field
        self.message = message


def parse_spec(raw: dict[str, Any] | None) -> DisaggServingSpec:
    """Validate a raw spec; raise InvalidSpecError naming the first bad field."""
    try:
        spec = DisaggServingSpec.model_validate(raw or {})
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise InvalidSpecError(where, _humanize(first)) from None
    check_kv_heads(spec)
    for role in ("prefill", "decode"):
        check_parallel_layout(role, getattr(spec, role))
    check_placement(spec)
    if spec.proxy.store_routing and spec.kv_transfer.implementation == "vllm":
        raise InvalidSpecError("proxy.storeRouting", (
            "the proxy computes the kvhelper connector's store keys, and "
            "kvTransfer.implementation vllm stores under its own: set proxy.storeRouting to "
            "false (vLLM's connector looks up stored prefixes on every instance itself)"))
    if spec.store.replicas and spec.kv_transfer.connector != ConnectorName.MOONCAKE_STORE:
        raise InvalidSpecError("store.replicas", (
            f"store pods hold the Mooncake store's memory, and kvTransfer.connector is "
            f"{spec.kv_transfer.connector.value}: set store.replicas to 0, or use the "
            "MooncakeStore connector"))
    check_etcd_tls(spec)
    if spec.proxy.local_prefill_tokens and not store_routing(spec):
        raise InvalidSpecError("proxy.localPrefillTokens", (
            "only applies when the proxy routes on what the store holds, and here it does "
            "not: set proxy.storeRouting to true (kvhelper's MooncakeStore connector, "
            "loadFailurePolicy Recompute), or localPrefillTokens to 0"))
    if spec.proxy.store_routing and spec.kv_transfer.load_failure_policy == "Fail":
        raise InvalidSpecError("proxy.storeRouting", (
            "skipping prefill relies on decode recomputing a prompt whose pages were evicted "
            "after the proxy looked, but kvTransfer.loadFailurePolicy is Fail: set "
            "loadFailurePolicy to Recompute, or proxy.storeRouting to false"))
    return spec


def check_etcd_tls(spec: DisaggServingSpec) -> None:
    """TLS to etcd needs a serving certificate when the operator runs etcd, and no client
    that cannot speak it: Mooncake's etcd client (libetcd_wrapper, used for transfer-engine
    metadata and the masters' HA election) has no TLS settings."""
    tls = spec.etcd.tls
    if tls is None:
        return
    if spec.etcd.mode == "Managed" and not tls.server_secret:
        raise InvalidSpecError("etcd.tls.serverSecret", (
            "is required for a managed etcd with TLS: name a Secret with its serving "
            "certificate (e.g. one cert-manager issues for the etcd-client Service)"))
    if spec.etcd.mode == "External" and tls.server_secret:
        raise InvalidSpecError("etcd.tls.serverSecret", (
            "is for a managed etcd; an external etcd has its own serving certificate: "
            "remove serverSecret"))
    if spec.kv_transfer.connector != ConnectorName.MOONCAKE_STORE:
        return
    if spec.kv_transfer.mooncake.metadata_backend == "etcd":
        raise InvalidSpecError("kvTransfer.mooncake.metadataBackend", (
            "is etcd, but Mooncake's etcd client cannot use TLS: set it to P2PHANDSHAKE "
            "(no metadata server), or remove etcd.tls"))
    if spec.mooncake_master.replicas > 1:
        raise InvalidSpecError("mooncakeMaster.replicas", (
            "above 1 elects the masters' leader through etcd, and Mooncake's etcd client "
            "cannot use TLS: set replicas to 1, or remove etcd.tls"))


def store_routing(spec: DisaggServingSpec) -> bool:
    """Whether the proxy routes on what the store holds (proxy.storeRouting, or its default)."""
    if (spec.kv_transfer.connector != ConnectorName.MOONCAKE_STORE
            or spec.kv_transfer.implementation != "kvhelper"):
        return False
    if spec.proxy.store_routing is not None:
        return spec.proxy.store_routing
    return spec.kv_transfer.load_failure_policy == "Recompute"


def gpus_per_pod(role_spec: RoleSpec) -> int:
    """GPUs each pod of an instance holds: its ranks (TP x DP) over its nodes."""
    world = role_spec.tensor_parallel_size * role_spec.data_parallel_size
    return world // role_spec.nodes_per_instance


def check_parallel_layout(role: str, role_spec: RoleSpec) -> None:
    """An instance's ranks must fill its nodes evenly (vLLM's own multi-node check)."""
    tp, dp = role_spec.tensor_parallel_size, role_spec.data_parallel_size
    nodes, world = role_spec.nodes_per_instance, tp * dp
    if world % nodes:
        raise InvalidSpecError(f"{role}.nodesPerInstance", (
            f"{nodes} nodes cannot hold TP {tp} x DP {dp} = {world} ranks evenly: pick a "
            f"node count that divides {world}, or change tensorParallelSize/dataParallelSize"))
    per_node = world // nodes
    if per_node % tp and tp % per_node:
        raise InvalidSpecError(f"{role}.nodesPerInstance", (
            f"each node would hold {per_node} ranks, which splits TP groups of {tp} unevenly "
            "across nodes: make the ranks per node a multiple or a divisor of "
            "tensorParallelSize"))
    given = role_spec.gpus_per_node
    if given is not None and given != world // nodes:
        raise InvalidSpecError(f"{role}.gpusPerNode", (
            f"TP {tp} x DP {dp} over {nodes} node(s) needs {world // nodes} GPUs per node, "
            f"not {given}: fix gpusPerNode or the parallel sizes"))


def check_placement(spec: DisaggServingSpec) -> None:
    if spec.prefill.affinity_to_prefill is not None:
        raise InvalidSpecError("prefill.affinityToPrefill", (
            "is for decode: set decode.affinityToPrefill to keep decode near prefill"))
    for role in ("prefill", "decode"):
        role_spec: RoleSpec = getattr(spec, role)
        if role_spec.exclusive_topology and role_spec.nodes_per_instance == 1:
            raise InvalidSpecError(f"{role}.exclusiveTopology", (
                "places LeaderWorkerSet groups (nodesPerInstance above 1); for one-node "
                f"instances use {role}.affinity (pod anti-affinity) instead"))
    if spec.kv_transfer.mooncake.rdma_resource and spec.kv_transfer.mooncake.protocol != "rdma":
        raise InvalidSpecError("kvTransfer.mooncake.rdmaResource", (
            "is requested only with protocol rdma: set kvTransfer.mooncake.protocol to rdma, "
            "or remove rdmaResource"))


@dataclass(frozen=True)
class SpecWarning:
    """Something a valid spec leaves unchecked or likely unintended: shown as a condition."""

    reason: str
    message: str


def spec_warnings(spec: DisaggServingSpec) -> list[SpecWarning]:
    """What a valid spec leaves to be found at the pods' start rather than up front."""
    warnings = []
    tp = {role: getattr(spec, role).tensor_parallel_size for role in ("prefill", "decode")}
    if spec.model.kv_heads is None and (max(tp.values()) > 1 or "store_tp_size" in
                                        spec.kv_transfer.extra_config):
        warnings.append(SpecWarning("KVHeadsUnset", (
            f"model.kvHeads is unset, so the TP sizes (prefill {tp['prefill']}, decode "
            f"{tp['decode']}) are checked against the model's K/V heads only when the pods "
            "start, where a mismatch stops every instance: set model.kvHeads to the "
            "model's num_key_value_heads (1 for MLA models such as DeepSeek)")))
    return warnings


def check_kv_heads(spec: DisaggServingSpec) -> None:
    """With model.kvHeads given, what the kvhelper connector would refuse at start-up
    (kvhelper.tp): TP sizes that do not split the heads, and a store_tp_size that does not
    divide them or would put a shard across two ranks."""
    heads = spec.model.kv_heads
    if heads is None:
        return
    roles = {"prefill": spec.prefill.tensor_parallel_size,
             "decode": spec.decode.tensor_parallel_size}
    for role, tp in roles.items():
        if (heads % tp if heads >= tp else tp % heads):
            raise InvalidSpecError(
                f"{role}.tensorParallelSize",
                f"TP {tp} does not split the model's {heads} KV heads (model.kvHeads): use a "
                f"divisor or a multiple of {heads}")
    if spec.kv_transfer.connector != ConnectorName.MOONCAKE_STORE:
        return
    requested = spec.kv_transfer.extra_config.get("store_tp_size")
    if requested is None and len(set(roles.values())) > 1:
        requested, field = math.lcm(*roles.values()), "prefill.tensorParallelSize"
        why = (f"the TP sizes {roles['prefill']} (prefill) and {roles['decode']} (decode) "
               f"need store_tp_size {requested}, their least common multiple, which")
    else:
        field = "kvTransfer.extraConfig.store_tp_size"
        why = f"store_tp_size {requested}"
    if not isinstance(requested, int) or isinstance(requested, bool):
        return  # each instance uses its own TP size: always consistent
    shards = min(requested, heads)
    per_shard = heads // shards if heads % shards == 0 else 0
    spans = [role for role, tp in roles.items()
             if per_shard and (heads // tp if heads >= tp else 1) % per_shard]
    if not per_shard or spans:
        raise InvalidSpecError(field, (
            f"{why} does not divide the model's {heads} KV heads" if not per_shard else
            f"{why} puts a shard across two {spans[0]} ranks") + "; pick TP sizes whose least "
            f"common multiple divides {heads}, or set kvTransfer.extraConfig.store_tp_size to "
            f"a divisor of {heads} that is a multiple of every TP size")


def _humanize(error: Any) -> str:
    msg = str(error["msg"])
    if error["type"] == "extra_forbidden":
        return "unknown field; check its spelling against `kubectl explain disaggserving.spec`"
    if error["type"] == "missing":
        return "is required"
    return msg.removeprefix("Value error, ")
