"""The `disagg-operator` command line."""

from __future__ import annotations

import asyncio
import secrets
import socket
import sys
import threading
from pathlib import Path

import click
import yaml

from disagg_operator.association import Owner, name_problem
from disagg_operator.crd import render_crd_yaml
from disagg_operator.render import render_spec
from disagg_operator.spec import InvalidSpecError, parse_spec, spec_warnings

DEFAULT_SERVING_IMAGE = "disagg-operator/serving:0.1.0"


@click.group()
def main() -> None:
    """Run disaggregated vLLM serving on Kubernetes."""


@main.command()
def crd() -> None:
    """Print the DisaggServing CustomResourceDefinition."""
    click.echo(render_crd_yaml(), nl=False)


@main.command("render")
@click.argument("path", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--namespace", default="default", show_default=True)
@click.option("--image", "default_image", default=DEFAULT_SERVING_IMAGE, show_default=True,
              help="Serving image for specs that do not set one.")
@click.option("--operator-namespace", default=None,
              help="The operator's namespace, let through the NetworkPolicies.")
def render_cmd(path: Path, namespace: str, default_image: str,
               operator_namespace: str | None) -> None:
    """Print the objects the operator would create for a DisaggServing YAML file."""
    doc = yaml.safe_load(path.read_text())
    meta = doc.get("metadata") or {}
    name = str(meta.get("name", "unnamed"))
    try:
        if problem := name_problem(name):  # the operator's (and the CRD's) rule
            raise InvalidSpecError("", problem)
        spec = parse_spec(doc.get("spec"))
    except InvalidSpecError as err:
        click.echo(f"error: {path}: {err}", err=True)
        sys.exit(2)
    for warning in spec_warnings(spec):
        click.echo(f"warning: {path}: {warning.reason}: {warning.message}", err=True)
    owner = Owner(name, meta.get("namespace", namespace), "<uid>")
    objects = render_spec(owner, spec, default_image, operator_namespace=operator_namespace)
    click.echo(yaml.safe_dump_all(objects, sort_keys=False), nl=False)


@main.command("run")
@click.option("--namespace", "namespaces", multiple=True,
              help="Watch only this namespace (repeatable). Default: all namespaces.")
@click.option("--default-image", default=DEFAULT_SERVING_IMAGE, show_default=True,
              envvar="DISAGG_DEFAULT_IMAGE", help="Serving image for specs that do not set one.")
@click.option("--resync-seconds", default=60.0, show_default=True,
              help="Re-check a Ready DisaggServing this often even without events.")
@click.option("--cluster-domain", default="cluster.local", show_default=True)
@click.option("--metrics-port", default=8081, show_default=True, type=int,
              help="Prometheus metrics on this port (0 disables).")
@click.option("--health-port", default=8080, show_default=True, type=int,
              help="kopf's liveness endpoint /healthz on this port (0 disables).")
@click.option("--log-format", type=click.Choice(["plain", "full", "json"]), default="full",
              show_default=True)
@click.option("--verbose", is_flag=True, help="Log every API call kopf makes.")
@click.option("--etcd-address", "etcd_addresses", multiple=True, metavar="ENDPOINT=HOST:PORT",
              help="Where to reach an etcd endpoint whose cluster name does not resolve here "
              "(an operator run outside the cluster, e.g. through kubectl port-forward); "
              "repeatable.")
@click.option("--operator-namespace", envvar="POD_NAMESPACE", default=None,
              help="The namespace the operator's pod runs in (the chart sets POD_NAMESPACE): "
              "the serving pods' NetworkPolicies let it through for its etcd health check and "
              "the planner's metrics scrape. Unset outside a cluster.")
@click.option("--leader-election/--no-leader-election", default=False, show_default=True,
              help="Reconcile only while holding the Lease (for several replicas; the chart "
              "turns it on).")
@click.option("--leader-id", envvar="POD_NAME", default=None,
              help="This replica's name in the Lease (the chart sets POD_NAME); default: the "
              "host name and a random suffix.")
@click.option("--lease-seconds", default=15.0, show_default=True,
              help="How long a leader's Lease lasts without renewal; a standby takes over "
              "within about this long after the leader dies.")
@click.option("--etcd-tls-dir", type=click.Path(file_okay=False, path_type=Path),
              envvar="DISAGG_ETCD_TLS_DIR", default=None,
              help="ca.crt, tls.crt and tls.key: the operator's own client certificate for "
              "the health check of external etcds with TLS (the chart mounts "
              "etcdClientTLS.secretName here).")
def run_cmd(namespaces: tuple[str, ...], default_image: str, resync_seconds: float,
            cluster_domain: str, metrics_port: int, health_port: int, log_format: str,
            verbose: bool, etcd_addresses: tuple[str, ...],
            operator_namespace: str | None, leader_election: bool, leader_id: str | None,
            lease_seconds: float, etcd_tls_dir: Path | None) -> None:
    """Run the operator against the cluster of $KUBECONFIG or the pod's service account."""
    overrides = {}
    for item in etcd_addresses:
        endpoint, sep, address = item.partition("=")
        if not sep or ":" not in address:
            raise click.BadParameter(f"{item!r}: give ENDPOINT=HOST:PORT, e.g. "
                                     "x-etcd-client.ns.svc.cluster.local:2379=127.0.0.1:2379",
                                     param_hint="--etcd-address")
        overrides[endpoint] = address
    try:
        import kopf

        from disagg_operator.handlers import OperatorConfig, registry
        from disagg_operator.leader import ElectionSettings
    except ImportError as err:
        raise click.ClickException(
            f"the controller needs {err.name}: pip install 'disagg-operator[controller]' "
            "(the operator image has it)") from None

    kopf.configure(verbose=verbose, log_format=kopf.LogFormat[log_format.upper()])
    stop_flag, lease_lost = asyncio.Event(), threading.Event()
    election = None
    if leader_election:
        identity = leader_id or f"{socket.gethostname()}-{secrets.token_hex(3)}"
        # client-go's proportions: renew within 2/3 of the lease, retry at 2/15 of it.
        election = ElectionSettings(identity, lease_seconds, lease_seconds * 2 / 3,
                                    lease_seconds * 2 / 15)
    config = OperatorConfig(default_image=default_image, resync_seconds=resync_seconds,
                            cluster_domain=cluster_domain, metrics_port=metrics_port or None,
                            etcd_address_overrides=overrides, etcd_tls_dir=etcd_tls_dir,
                            operator_namespace=operator_namespace, leader_election=election,
                            lease_namespace=operator_namespace or "default",
                            stop_flag=stop_flag, lease_lost=lease_lost)
    kopf.run(registry=registry, standalone=True, clusterwide=not namespaces,
             namespaces=list(namespaces), memo=kopf.Memo(config=config), stop_flag=stop_flag,
             liveness_endpoint=f"http://0.0.0.0:{health_port}/healthz" if health_port else None)
    if lease_lost.is_set():
        raise click.ClickException("lost the leader lease; exiting to restart as a standby")


if __name__ == "__main__":
    main()
