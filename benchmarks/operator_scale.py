"""Benchmark: the operator converging N DisaggServings in the API emulator.

Runs the real `disagg-operator run` as a subprocess (so its memory is measured alone) against
the emulator hosted by this script, with a real etcd as every DisaggServing's external etcd.
Prints: time to converge, API writes per DisaggServing (first reconcile and steady state),
reconcile time (p50/mean from the operator's own histogram), and peak RSS, each beside a
baseline measured in the same run. Bounded: N objects, fixed deadlines.

    .venv/bin/python benchmarks/operator_scale.py --count 200
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import aiohttp
from disagg_devtools.emulator.sandbox import Sandbox, sandbox
from disagg_devtools.etcd_process import EtcdProcess
from disagg_devtools.processes import exit_on_sigterm, free_port, stop_process
from disagg_devtools.waiting import wait_for
from disagg_operator.spec import GROUP, PLURAL, VERSION
from prometheus_client.parser import text_string_to_metric_families

NAMESPACE = "bench"


def body(index: int, etcd: str) -> dict[str, object]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "DisaggServing",
            "metadata": {"name": f"dsv-{index:04d}", "namespace": NAMESPACE},
            "spec": {"model": {"name": "deepseek-ai/DeepSeek-V2-Lite", "trustRemoteCode": True},
                     "decode": {"replicas": 2},
                     "etcd": {"mode": "External", "endpoints": [etcd]}}}


def ready_count(box: Sandbox) -> int:
    count = 0
    for (res, _, _), obj in box.emulator.objects.items():
        if res.plural != PLURAL or obj.deleted:
            continue
        for cond in (obj.raw.get("status") or {}).get("conditions") or []:
            if cond["type"] == "Ready" and cond["status"] == "True":
                count += 1
    return count


def writes(box: Sandbox, since: int) -> int:
    return sum(1 for r in box.emulator.request_log[since:]
               if r.is_write and not r.dry_run and r.plural != "events")


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def reconcile_stats(metrics: dict[str, list[tuple[dict[str, str], float]]]) -> tuple[
        float, float, float]:
    """(count, mean seconds, p50 seconds interpolated in the summed histogram buckets)."""
    count = sum(v for _, v in metrics.get("disagg_operator_reconcile_duration_seconds_count", []))
    total = sum(v for _, v in metrics.get("disagg_operator_reconcile_duration_seconds_sum", []))
    buckets: dict[float, float] = {}
    for labels, value in metrics.get("disagg_operator_reconcile_duration_seconds_bucket", []):
        bound = float(labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + value
    p50, previous_bound, previous_count = 0.0, 0.0, 0.0
    for bound in sorted(buckets):
        if buckets[bound] >= count / 2:
            share = (count / 2 - previous_count) / max(buckets[bound] - previous_count, 1e-9)
            p50 = previous_bound + share * (min(bound, 60.0) - previous_bound)
            break
        previous_bound, previous_count = bound, buckets[bound]
    return count, total / max(count, 1), p50


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


async def list_roundtrip(box: Sandbox, samples: int = 50) -> float:
    """Median time of one labelled list call: the API floor under each reconcile's 4 lists."""
    url = (f"{box.server_url.rstrip('/')}/apis/apps/v1/namespaces/{NAMESPACE}/deployments"
           "?labelSelector=app.kubernetes.io%2Finstance%3Ddsv-0000")
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(samples):
            started = time.perf_counter()
            async with session.get(url) as response:
                await response.read()
            times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


async def main(count: int, deadline: float) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-operator-") as scratch:
        work = Path(scratch)
        etcd = await EtcdProcess(work / "etcd").start()
        try:
            async with sandbox(work / "cluster") as box:
                return await run(box, etcd, count, deadline, work)
        finally:
            etcd.stop()


async def run(box: Sandbox, etcd: EtcdProcess, count: int, deadline: float,
              work: Path) -> int:
    metrics_port = free_port()
    watches = box.watch_count()
    log = (work / "operator.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "disagg_operator.cli", "run", "--metrics-port", str(metrics_port),
         "--health-port", "0", "--resync-seconds", "3", "--log-format", "plain"],
        env={**os.environ, "KUBECONFIG": str(box.kubeconfig)}, stdout=log,
        stderr=subprocess.STDOUT)
    try:
        await wait_for(lambda: box.watch_count() >= watches + 5 or proc.poll() is not None,
                       60, "the operator's watches")
        if proc.poll() is not None:
            print(f"operator exited: see {work / 'operator.log'}")
            return 1
        idle_rss = rss_mb(proc.pid, "VmRSS")

        mark = len(box.emulator.request_log)
        first_cpu = cpu_seconds(proc.pid)
        started = time.perf_counter()
        url = f"{box.server_url.rstrip('/')}/apis/{GROUP}/{VERSION}/namespaces/{NAMESPACE}/{PLURAL}"
        async with aiohttp.ClientSession() as session:
            for index in range(count):
                async with session.post(url, json=body(index, etcd.endpoint)) as response:
                    assert response.status < 300, await response.text()
        created = time.perf_counter() - started
        await wait_for(lambda: ready_count(box) >= count, deadline, f"{count} Ready",
                       interval=0.5)
        converged = time.perf_counter() - started
        first_writes = writes(box, mark)
        first_count, first_mean, first_p50 = reconcile_stats(scrape(metrics_port))
        first_cpu = cpu_seconds(proc.pid) - first_cpu

        # Steady state: every object resyncs at least twice (resync every 3 s) with no change.
        steady_mark = len(box.emulator.request_log)
        steady_cpu = cpu_seconds(proc.pid)
        target = first_count + 2 * count
        await wait_for(lambda: reconcile_stats(scrape(metrics_port))[0] >= target, deadline,
                       "two resyncs of every object", interval=0.5)
        steady_writes = writes(box, steady_mark)
        total, mean, p50 = reconcile_stats(scrape(metrics_port))
        steady = total - first_count
        steady_cpu = cpu_seconds(proc.pid) - steady_cpu
        peak_rss = rss_mb(proc.pid, "VmHWM")
        floor = await list_roundtrip(box)

        print(f"DisaggServings:                 {count} (1P2D, 9 children each)")
        print(f"created in:                     {created:.2f} s")
        print(f"all Ready after:                {converged:.2f} s "
              f"({converged / count * 1000:.1f} ms per object)")
        print(f"API writes, first convergence:  {first_writes} "
              f"({first_writes / count:.1f} per DisaggServing: 9 applies + finalizer + status)")
        print(f"API writes, steady state:       {steady_writes} over {steady:.0f} resyncs "
              f"({steady_writes / max(steady, 1):.3f} per reconcile)")
        print(f"reconcile p50 / mean (all):     {p50 * 1000:.1f} ms / {mean * 1000:.1f} ms "
              f"over {total:.0f} reconciles")
        print(f"reconcile p50 (first phase):    {first_p50 * 1000:.1f} ms "
              f"(mean {first_mean * 1000:.1f} ms, {first_count:.0f} reconciles)")
        print(f"operator CPU, convergence:      {first_cpu:.1f} s "
              f"({first_cpu / max(first_count, 1) * 1000:.1f} ms per reconcile)")
        print(f"operator CPU per resync:        {steady_cpu / max(steady, 1) * 1000:.1f} ms "
              f"(CPU time of the operator process over the steady phase / reconciles)")
        print(f"baseline: one list call:        {floor * 1000:.2f} ms "
              f"(reconcile p50 = {p50 / floor:.1f}x a single list; a reconcile makes 4 lists)")
        print(f"operator RSS idle / peak:       {idle_rss:.0f} MB / {peak_rss:.0f} MB "
              f"(ratio {peak_rss / idle_rss:.2f}x)")
        ok = steady_writes == 0 and steady_cpu / max(steady, 1) < 0.050 and peak_rss < 150
        print("targets (steady writes 0, operator time < 50 ms per reconcile, RSS < 150 MB):",
              "met" if ok else "NOT met")
        return 0
    finally:
        stop_process(proc, grace=15)
        log.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--count", type=int, default=200)
    parser.add_argument("--deadline", type=float, default=300.0,
                        help="Seconds allowed for each phase.")
    args = parser.parse_args()
    exit_on_sigterm()  # stopped with kill: still stop what it started
    sys.exit(asyncio.run(main(args.count, args.deadline)))
