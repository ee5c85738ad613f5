"""P/D that silently degrades while every pod reports healthy is reported: the Degraded
condition, from the proxy's and decode's counters (stand-in metric pages here), when the proxy
answers requests with decode alone or decode's KV loads fail; and back to AsExpected once
requests are prefilled and loaded again."""

from __future__ import annotations

import pytest
from disagg_devtools.emulator.metric_pages import EnginePage, MetricPagesServer, ProxyPage
from disagg_devtools.emulator.sandbox import Sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_operator.handlers import OperatorConfig

from .conftest import Api, example, fast_config
from .stand_in_pods import add_pods, metric_overrides


@pytest.fixture
def config(etcd: EtcdProcess, pages: MetricPagesServer) -> OperatorConfig:
    return fast_config(etcd, metrics_address_overrides=metric_overrides(pages),
                       transfer_window_seconds=0.5)


def traffic(pages: MetricPagesServer, requests: int, alone: int = 0, failed: int = 0) -> None:
    proxy = pages.pages["dsv2-lite-proxy-a"]
    decode = pages.pages["dsv2-lite-decode-a"]
    assert isinstance(proxy, ProxyPage) and isinstance(decode, EnginePage)
    proxy.arrived.inc(requests)
    proxy.decode_alone.inc(alone)
    decode.loads.inc(requests - alone - failed)
    decode.loads_failed.inc(failed)


async def test_decode_alone_and_failing_loads_show_as_degraded(cluster: Sandbox, api: Api,
                                                               pages: MetricPagesServer) -> None:
    add_pods(cluster)
    await api.create(example("deepseek-v2-lite-1p2d.yaml"))
    await api.wait_condition("dsv2-lite", "Ready", "True", "AllComponentsReady")

    async def settle(reason: str) -> dict:  # a new interval after each burst
        return await api.wait_condition("dsv2-lite", "Degraded",
                                        "False" if reason == "AsExpected" else "True", reason)

    traffic(pages, 20)
    await settle("AsExpected")
    traffic(pages, 20, alone=12)
    cond = await settle("DecodeAlone")
    assert "12 of " in cond["message"] and "answered by decode alone" in cond["message"], cond
    assert api.condition("dsv2-lite", "Ready")["status"] == "True"  # still serving
    traffic(pages, 20)
    await settle("AsExpected")
    traffic(pages, 20, failed=5)
    cond = await settle("KVLoadsFailing")
    assert "5 of " in cond["message"] and "KV loads on decode" in cond["message"], cond
    assert any(e["reason"] == "Degraded" for e in api.events())
    traffic(pages, 20)
    await settle("AsExpected")
