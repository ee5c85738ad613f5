"""Counters read from the Prometheus text that vLLM servers serve on /metrics."""

from __future__ import annotations

import urllib.request


def metric_total(text: str, name: str) -> float:
    """The sum of every sample of `name`, whatever its labels, in Prometheus text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith((name + "{", name + " ")))


def scrape_total(urls: list[str], name: str, timeout: float = 10.0) -> float:
    """`metric_total` of `name` over the /metrics of every server in `urls`."""
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=timeout) as response:
            total += metric_total(response.read().decode(), name)
    return total
