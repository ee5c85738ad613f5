"""The chaos soak (benchmarks/chaos.py), short: a local 2P2D deployment of the tiny MLA model
(two proxies, two masters in HA mode, a store pod, etcd) under load loses, one after another,
a registrar, a proxy, etcd, the leading master, the store pod (SIGKILL, each restarted as the
kubelet would) and a decode vLLM (SIGSTOP, then resumed). It replaces the test that killed the
leading master alone. No answer may be wrong (the exactness
criterion against a plain instance), no request may fail except one in flight at the proxy
that was killed, and the deployment must be whole again after every fault."""

from __future__ import annotations

from types import ModuleType

import pytest
from disagg_devtools.benchmark_scripts import load_benchmark

from .conftest import in_private_network

PLAN = [("registrar", "kill"), ("proxy", "kill"), ("etcd", "kill"), ("master", "kill"),
        ("store", "kill"), ("decode", "stop")]


def benchmark() -> ModuleType:
    return load_benchmark("chaos")


def test_a_short_chaos_soak_gives_no_wrong_answer_and_loses_only_what_a_killed_proxy_held(
        tiny_models, tmp_path) -> None:
    if not in_private_network():
        pytest.fail("run in a network namespace (`make test` uses `unshare -n`)")
    chaos = benchmark()
    args = chaos.parser().parse_args([
        "--seconds", "75", "--interval", "2", "4", "--restart-delay", "1",
        "--stop-seconds", "6", "--prompts", "12", "--seed", "7",
        "--max-requests", "2000", "--model", str(tiny_models["mla"])])
    report = chaos.run(args, plan=PLAN, work=tmp_path)
    print(report.table())
    assert len(report.faults) == len(PLAN), [f.kind for f in report.faults]
    assert all(f.recovered is not None for f in report.faults), report.table()
    assert report.wrong == 0, [o.detail for o in report.outcomes if o.wrong]
    killed_proxy = next(f for f in report.faults if f.kind == "kill proxy")
    unexplained = [o for o in report.failed()
                   if not (o.phase == "proxy" and o.started <= killed_proxy.at <= o.ended)]
    assert unexplained == [], [(o.phase, o.detail) for o in unexplained]
    assert len(report.outcomes) > 60  # the load ran through the faults
