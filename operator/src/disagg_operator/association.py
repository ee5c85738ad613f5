"""The one place that associates a DisaggServing with its children: their names, labels,
selectors and owner references.

Every child is named `<owner>-<suffix>`. Kubernetes needs Service names (and the StatefulSet's
pods' hostnames) to be DNS labels of at most 63 characters, so the longest suffix sets how long
a DisaggServing's own name may be. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The owner's API identity.
GROUP = "serving.disagg.dev"
VERSION = "v1alpha1"
KIND = "DisaggServing"

MANAGED_BY = "disagg-operator"
PART_OF = "disagg-serving"
LABEL_INSTANCE = "app.kubernetes.io/instance"
LABEL_COMPONENT = "app.kubernetes.io/component"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"

DNS_LABEL_MAX = 63
CONFIG = "config"  # the ConfigMap of config files (mooncake.json)
ETCD = "etcd"  # the managed etcd StatefulSet and its headless peer Service
ETCD_CLIENT = "etcd-client"  # the managed etcd's client Service
MOONCAKE_MASTER = "mooncake-master"
STORE = "store"  # dedicated Mooncake store pods
PREFILL, DECODE, PROXY = "prefill", "decode", "proxy"
SUFFIXES = (CONFIG, ETCD, ETCD_CLIENT, MOONCAKE_MASTER, STORE, PREFILL, DECODE, PROXY)
MAX_NAME_LENGTH = DNS_LABEL_MAX - max(len(f"-{suffix}") for suffix in SUFFIXES)


def child_name(owner_name: str, suffix: str) -> str:
    return f"{owner_name}-{suffix}"  # (a Role's format is its value)


def name_problem(owner_name: str) -> str | None:
    """Why `owner_name` cannot name a DisaggServing, or None."""
    if len(owner_name) <= MAX_NAME_LENGTH:
        return None
    longest = max(SUFFIXES, key=len)
    return (f"metadata.name is {len(owner_name)} characters; at most {MAX_NAME_LENGTH} fit, "
            f"because child names append up to {DNS_LABEL_MAX - MAX_NAME_LENGTH} (e.g. "
            f"'-{longest}') and must stay DNS labels of at most {DNS_LABEL_MAX}: recreate it "
            "under a shorter name")


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str

    def reference(self) -> dict[str, Any]:
        """The controller ownerReference every child carries: deleted with its owner."""
        return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": self.name,
                "uid": self.uid, "controller": True, "blockOwnerDeletion": True}


# app.kubernetes.io/name per component: what software runs there.
_APP_NAMES = {PREFILL: "vllm", DECODE: "vllm", PROXY: "disagg-proxy",
              MOONCAKE_MASTER: "mooncake-master", STORE: "mooncake-store", ETCD: "etcd"}


def selector_labels(owner_name: str, component: str) -> dict[str, str]:
    """Immutable Deployment/StatefulSet selectors: never add to these."""
    return {LABEL_INSTANCE: owner_name, LABEL_COMPONENT: str(component)}


def owned_labels(owner_name: str) -> dict[str, str]:
    """The labels that find every child of one DisaggServing."""
    return {LABEL_INSTANCE: owner_name, LABEL_MANAGED_BY: MANAGED_BY}


def child_labels(owner_name: str, component: str) -> dict[str, str]:
    """Every label of a child (and of its pods)."""
    return {
        "app.kubernetes.io/name": _APP_NAMES.get(str(component), str(component)),
        **selector_labels(owner_name, component),
        "app.kubernetes.io/part-of": PART_OF,
        LABEL_MANAGED_BY: MANAGED_BY,
    }


def child_meta(owner: Owner, name: str, component: str) -> dict[str, Any]:
    """A child's metadata: its name, namespace, labels and owner reference."""
    return {"name": name, "namespace": owner.namespace,
            "labels": child_labels(owner.name, component),
            "ownerReferences": [owner.reference()]}
