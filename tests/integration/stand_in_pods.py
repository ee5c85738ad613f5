"""Serving pods for the operator's scrapes in the API emulator, whose pods run nothing: Running
pods with IPs, as the kubelet would report them, and stand-in metric pages on loopback that the
scraper's address overrides point them at."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import kmock
from disagg_devtools.emulator.metric_pages import EnginePage, MetricPagesServer, ProxyPage
from disagg_devtools.emulator.sandbox import Sandbox

NAMESPACE = "default"
PODS = {  # pod -> (role, IP)
    "dsv2-lite-prefill-a": ("prefill", "10.0.0.1"),
    "dsv2-lite-decode-a": ("decode", "10.0.0.2"),
    "dsv2-lite-decode-b": ("decode", "10.0.0.3"),
    "dsv2-lite-proxy-a": ("proxy", "10.0.0.4"),
}


@asynccontextmanager
async def metric_pages() -> AsyncIterator[MetricPagesServer]:
    server = MetricPagesServer({name: ProxyPage() if role == "proxy" else EnginePage(
        num_gpu_blocks=1000, block_size=16) for name, (role, _) in PODS.items()})
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


def metric_overrides(pages: MetricPagesServer) -> dict[str, str]:
    """The operator's scrape address overrides: each pod's IP:8000 to its page."""
    return {f"{ip}:{8000}": pages.address(name) for name, (_, ip) in PODS.items()}


def add_pods(cluster: Sandbox) -> None:
    """Running pods with IPs, as the kubelet would report them."""
    for name, (role, ip) in PODS.items():
        cluster.emulator.objects[kmock.resource("", "v1", "pods"), NAMESPACE, name] = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE, "labels": {
                "app.kubernetes.io/instance": "dsv2-lite",
                "app.kubernetes.io/managed-by": "disagg-operator",
                "app.kubernetes.io/component": role}},
            "status": {"phase": "Running", "podIP": ip}}
