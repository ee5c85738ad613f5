"""Every reason the operator writes into a DisaggServing's conditions, with what it means and
what to do about it. The API reference (docs/reference/conditions.md) is generated from this
table, and a test keeps it complete against the code that sets the reasons."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Reason:
    name: str
    conditions: tuple[str, ...]  # the condition types that use it, as "Type=Status"
    meaning: str
    action: str  # "" where nothing needs doing


REASONS: tuple[Reason, ...] = (
    Reason("AllComponentsReady", ("Ready=True",),
           "Every component has all its desired instances ready.", ""),
    Reason("Serving", ("Ready=True",),
           "Every component has at least one ready instance, some fewer than desired "
           "(starting, rolling out, or lost).",
           "Read the message for the short components; Degraded says why if it knows."),
    Reason("ComponentsNotReady", ("Ready=False",),
           "Some component has no ready instance yet: requests cannot be served.",
           "Normal while pods start (model download, engine start). Otherwise "
           "`kubectl get pods -l app.kubernetes.io/instance=NAME` and the pods' events."),
    Reason("ScaledToZero", ("Ready=False",),
           "A serving role has 0 replicas.", "Scale the role up to serve requests."),
    Reason("EtcdUnhealthy", ("Ready=False", "Degraded=True"),
           "The DisaggServing's etcd does not answer the operator's health check; instances "
           "cannot register and the proxy cannot discover them.",
           "Managed etcd: its StatefulSet's pod and volume. External: `spec.etcd.endpoints`, "
           "and with TLS the chart's `etcdClientTLS.secretName`."),
    Reason("SecretMissing", ("Ready=False", "Progressing=False", "Degraded=True"),
           "A Secret (or a key in it) that pods mount or read is missing, so they cannot "
           "start. The message names the Secret and the spec field that names it.",
           "Create the Secret in the DisaggServing's namespace, or point the field at one "
           "that exists."),
    Reason("InvalidSpec", ("Ready=False", "Progressing=False", "Degraded=True"),
           "The spec passes the schema but cannot be served; nothing is applied. The message "
           "names the field and the fix.", "Fix the named field."),
    Reason("LeaderWorkerSetMissing", ("Ready=False", "Progressing=False", "Degraded=True"),
           "An instance spans nodes (`nodesPerInstance` above 1), and the cluster does not "
           "serve the LeaderWorkerSet kind.",
           "Install the LeaderWorkerSet controller, or set `nodesPerInstance` to 1."),
    Reason("ApplyFailed", ("Ready=False", "Degraded=True"),
           "The API server refused a child object; none of the change was applied.",
           "The message quotes the API server; often an admission webhook, a quota or an "
           "immutable field."),
    Reason("Conflict", ("Ready=False", "Degraded=True"),
           "An object with a child's name exists and does not belong to this "
           "DisaggServing; the operator never takes it over.",
           "Delete or rename that object, or give the DisaggServing another name."),
    Reason("RollingOut", ("Progressing=True",),
           "Workloads are rolling out a changed spec; the message counts updated and ready "
           "instances.", ""),
    Reason("KVRollout", ("Progressing=True",),
           "A change of KV compatibility (model, block size, dtype, connector, image) rolls "
           "new prefill and decode instances out beside the old; the proxy pairs only equal "
           "ones.", "Wait; a new role that cannot start keeps the old instances serving."),
    Reason("RolloutComplete", ("Progressing=False",),
           "Every component runs the latest spec.", ""),
    Reason("AsExpected", ("Degraded=False",), "No component reports a failure.", ""),
    Reason("WorkloadFailing", ("Degraded=True",),
           "A Deployment or StatefulSet reports its rollout stuck (progress deadline, "
           "replica failure).", "`kubectl describe` the workload named in the message."),
    Reason("InstancesFailing", ("Degraded=True",),
           "Containers keep exiting with an error; the message quotes the end of their "
           "output (e.g. the connector refusing its configuration).",
           "Fix what the quoted message says; `kubectl logs --previous` has the rest."),
    Reason("ReducedCapacity", ("Degraded=True",),
           "A component finished rolling out with fewer ready instances than desired.",
           "Check the missing pods: scheduling (resources, node selectors) or crashes."),
    Reason("DecodeAlone", ("Degraded=True",),
           "More than a tenth of the proxy's requests in the last interval were answered by "
           "decode alone, without prefill: P/D silently degraded.",
           "Check the prefill pods and their registration (the proxy's `/instances`, "
           "`disagg_proxy_decode_alone_total` by reason)."),
    Reason("KVLoadsFailing", ("Degraded=True",),
           "More than a tenth of decode's KV loads failed in the last interval; those prompts "
           "were recomputed.",
           "Check the Mooncake master and store (`vllm:kvhelper_blocks_load_failed_total`, "
           "decode logs)."),
    Reason("NoWarnings", ("ConfigWarning=False",), "The spec leaves nothing unchecked.", ""),
    Reason("KVHeadsUnset", ("ConfigWarning=True",),
           "`model.kvHeads` is unset and a TP size is above 1, so the TP sizes are checked "
           "against the model's K/V heads only when the pods start.",
           "Set `model.kvHeads` to the model's `num_key_value_heads` (1 for MLA models)."),
)


def reason(name: str) -> Reason:
    return next(r for r in REASONS if r.name == name)
