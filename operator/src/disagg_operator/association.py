"""The one place that associates a DisaggServing with its children's names.

Every child is named `<owner>-<suffix>`. Kubernetes needs Service names (and the StatefulSet's
pods' hostnames) to be DNS labels of at most 63 characters, so the longest suffix sets how long
a DisaggServing's own name may be. Pure: no I/O.
"""

from __future__ import annotations

DNS_LABEL_MAX = 63
CONFIG = "config"  # the ConfigMap of config files (mooncake.json)
ETCD = "etcd"  # the managed etcd StatefulSet and its headless peer Service
ETCD_CLIENT = "etcd-client"  # the managed etcd's client Service
MOONCAKE_MASTER = "mooncake-master"
PREFILL, DECODE, PROXY = "prefill", "decode", "proxy"
SUFFIXES = (CONFIG, ETCD, ETCD_CLIENT, MOONCAKE_MASTER, PREFILL, DECODE, PROXY)
MAX_NAME_LENGTH = DNS_LABEL_MAX - max(len(f"-{suffix}") for suffix in SUFFIXES)


def child_name(owner_name: str, suffix: str) -> str:
    return f"{owner_name}-{suffix}"


def name_problem(owner_name: str) -> str | None:
    """Why `owner_name` cannot name a DisaggServing, or None."""
    if len(owner_name) <= MAX_NAME_LENGTH:
        return None
    longest = max(SUFFIXES, key=len)
    return (f"metadata.name is {len(owner_name)} characters; at most {MAX_NAME_LENGTH} fit, "
            f"because child names append up to {DNS_LABEL_MAX - MAX_NAME_LENGTH} (e.g. "
            f"'-{longest}') and must stay DNS labels of at most {DNS_LABEL_MAX}: recreate it "
            "under a shorter name")
