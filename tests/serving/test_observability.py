"""The chart's dashboard and alerts read metrics that exist: every PromQL expression parses
(a PromQL parser, not a regular expression), every metric it selects is one that this
project's code, vLLM or the Mooncake master exports, and the key metrics the code exports are
on the dashboard or in an alert."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from disagg_devtools.master_process import MooncakeMaster
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "disagg-operator"
# Exported by the code and worth a panel or an alert: each must be used.
KEY_METRICS = {
    "disagg_proxy_requests", "disagg_proxy_time_to_first_token_seconds",
    "disagg_proxy_route_decisions", "disagg_proxy_instances",
    "vllm:kvhelper_load_seconds", "vllm:kvhelper_store_seconds", "vllm:kvhelper_bytes_loaded",
    "vllm:kvhelper_requests_load_failed", "disagg_operator_reconcile_errors",
    "disagg_operator_reconcile_duration_seconds", "disagg_operator_instances",
    "master_allocated_bytes", "vllm:inter_token_latency_seconds",
}


def expressions() -> dict[str, str]:
    """Where -> PromQL, from the dashboard's targets and the alert rules."""
    found = {}
    dashboard = json.loads((CHART / "dashboards" / "disagg-serving.json").read_text())
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            found[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    for variable in dashboard["templating"]["list"]:
        if variable.get("definition"):  # label_values(METRIC, label): the metric must exist
            metric = re.fullmatch(r"label_values\((\S+), \w+\)", variable["definition"])
            assert metric, variable["definition"]
            found[f"variable {variable['name']}"] = metric.group(1)
    alerts = yaml.safe_load((CHART / "alerts" / "disagg-serving.yaml").read_text())
    for group in alerts["groups"]:
        for rule in group["rules"]:
            found[f"alert {rule['alert']}"] = rule["expr"]
    return found


def selected(node: Any) -> Iterator[str]:
    """The metric names a parsed expression selects."""
    if type(node).__name__ == "VectorSelector":
        yield node.name
        return
    for attribute in ("lhs", "rhs", "expr", "args", "param", "vector_selector"):
        child = getattr(node, attribute, None)
        for item in child if isinstance(child, list) else [child]:
            if item is not None and type(item).__module__ != "builtins":
                yield from selected(item)


def family(sample_name: str, families: set[str]) -> str:
    """The family a selected series belongs to (histogram and counter suffixes dropped)."""
    for suffix in ("_bucket", "_count", "_sum", "_total", ""):
        base = sample_name.removesuffix(suffix) if suffix else sample_name
        if base in families:
            return base
    return sample_name


def ours() -> set[str]:
    """What this project's code exports: the proxy's registry, the connector's metrics, the
    operator's."""
    from disagg_operator import metrics as operator_metrics
    from kvhelper.connector_metrics import COUNTERS, DURATIONS
    from kvhelper.proxy.app import InstancesCollector, Metrics
    from kvhelper.proxy.pool import Pool

    proxy = Metrics()
    proxy.registry.register(InstancesCollector(Pool()))
    names = {m.name for m in proxy.registry.collect()}
    names |= {f"vllm:kvhelper_{n}" for n in (*COUNTERS, *DURATIONS)}
    registry = CollectorRegistry()
    for metric in (operator_metrics.RECONCILE_SECONDS, operator_metrics.RECONCILE_ERRORS,
                   operator_metrics.API_WRITES, operator_metrics.INSTANCES):
        registry.register(metric)
    names |= {m.name for m in registry.collect()}
    return names


def vllms() -> set[str]:
    """Every metric name vLLM's Prometheus logger declares (its source, as installed)."""
    import vllm.v1.metrics.loggers as loggers

    source = Path(loggers.__file__).read_text()
    return {name.removesuffix("_total") for name in re.findall(r'"(vllm:[a-z_]+)"', source)}


@pytest.fixture(scope="module")
def masters(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What a real mooncake_master serves on its metrics port."""
    from .conftest import in_private_network

    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    master = MooncakeMaster(tmp_path_factory.mktemp("master") / "master.log").start()
    try:
        port = re.search(r"--metrics_port=(\d+)", " ".join(master.process.args))  # type: ignore[union-attr, arg-type]
        assert port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{port.group(1)}/metrics",
                                    timeout=10) as response:
            text = response.read().decode()
    finally:
        master.stop()
    return {f.name for f in text_string_to_metric_families(text)}


def test_every_expression_parses_and_selects_exported_metrics(masters: set[str]) -> None:
    exported = ours() | vllms() | masters
    unknown, used = {}, set()
    for where, expr in expressions().items():
        tree = promql_parser.parse(expr)  # raises on anything that is not PromQL
        for name in selected(tree):
            base = family(name, exported)
            used.add(base)
            if base not in exported:
                unknown[where] = name
    assert not unknown, unknown
    assert not KEY_METRICS - used, f"exported but on no panel or alert: {KEY_METRICS - used}"
    assert KEY_METRICS <= exported  # the key list names real metrics


def test_a_misspelt_metric_is_caught() -> None:
    """The control: a name nothing exports is reported, and broken PromQL does not parse."""
    exported = ours() | vllms()
    names = set(selected(promql_parser.parse('rate(disagg_proxy_request_totals[5m])')))
    assert {family(n, exported) for n in names} - exported == {"disagg_proxy_request_totals"}
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type
        promql_parser.parse("sum(rate(disagg_proxy_requests_total[5m])")
