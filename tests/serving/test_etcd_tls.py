"""kvhelper's etcd clients (registrar, proxy discovery, peer check) against a real etcd that
serves TLS and requires client certificates (spec.etcd.tls), with the TLS files named in the
environment as the rendered pods name them. The controls: the same clients without TLS, and
with a client certificate of another CA, get nothing from it."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from disagg_devtools.etcd_process import EtcdProcess, ServerTls
from disagg_devtools.processes import free_port
from disagg_devtools.waiting import wait_for
from disagg_operator.etcd_health import EtcdHealthChecker
from disagg_operator.plan import ETCD_METRICS_PORT
from kvhelper.discovery import EtcdDiscovery
from kvhelper.etcd_client import CA_ENV, CERT_ENV, KEY_ENV, EtcdTls
from kvhelper.instances import Instance
from kvhelper.registry import Registrar, RegistrarConfig

from .fake_vllm import FakeVLLM
from .pki import TestCa

PREFIX = "/disagg/test/tls/instances/"


def tls_env(folder: Path) -> dict[str, str]:
    return {CA_ENV: str(folder / "ca.crt"), CERT_ENV: str(folder / "tls.crt"),
            KEY_ENV: str(folder / "tls.key")}


@pytest.fixture
async def tls_etcd(tmp_path: Path) -> AsyncIterator[tuple[EtcdProcess, TestCa]]:
    ca = TestCa(tmp_path / "pki")
    server, client = ca.issue("etcd", server=True), ca.issue("health", server=False)
    proc = await EtcdProcess(tmp_path / "etcd", tls=ServerTls(
        ca=ca.ca_file, cert=server / "tls.crt", key=server / "tls.key",
        client_cert=client / "tls.crt", client_key=client / "tls.key",
        metrics_port=free_port())).start()
    yield proc, ca
    proc.stop()


def peer_check(etcd: EtcdProcess, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvhelper.peer_check", "--peer-role", "decode", "--fingerprint",
         "F", "--etcd", etcd.endpoint, "--prefix", PREFIX, "--timeout", "2"],
        capture_output=True, text=True, timeout=30, env={"PATH": "/usr/bin:/bin", **env})


async def test_registrar_discovery_and_peer_check_speak_tls_with_client_certificates(
        tls_etcd, tmp_path) -> None:
    etcd, ca = tls_etcd
    registrar_files = ca.issue("registrar", server=False)
    proxy_files = ca.issue("proxy", server=False)
    fake = await FakeVLLM("d0").start()
    stop = asyncio.Event()
    view: dict[str, Instance] = {}
    tasks = []
    try:
        instance = Instance(id="d0", role="decode", url=fake.url, model="m", fingerprint="F")
        registrar = Registrar(RegistrarConfig(
            instance=instance, health_url=f"{fake.url}/health",
            etcd=[("127.0.0.1", etcd.client_port)], prefix=PREFIX, ttl=4, interval=0.2,
            tls=EtcdTls.from_env(tls_env(registrar_files))))
        tasks.append(asyncio.create_task(registrar.run(stop)))
        discovery = EtcdDiscovery([("127.0.0.1", etcd.client_port)], PREFIX,
                                  backoff=(0.1,), tls=EtcdTls.from_env(tls_env(proxy_files)))
        tasks.append(asyncio.create_task(discovery.run(
            lambda found: (view.clear(), view.update(found)), stop)))
        await wait_for(lambda: [i.url for i in view.values()] == [fake.url], 15,
                       "the registration, seen through the TLS watch")

        passed = peer_check(etcd, tls_env(ca.issue("prefill-registrar", server=False)))
        assert passed.returncode == 0, passed.stdout + passed.stderr

        # The controls: no TLS at all, and a client certificate another CA signed.
        plaintext = peer_check(etcd, {})
        assert plaintext.returncode == 2 and "cannot ask etcd" in plaintext.stdout
        stranger = TestCa(tmp_path / "other-pki", "other-ca").issue("stranger", server=False)
        refused = peer_check(etcd, {**tls_env(stranger), CA_ENV: str(ca.ca_file)})
        assert refused.returncode == 2 and "cannot ask etcd" in refused.stdout
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 15)
        await fake.stop()


def test_tls_settings_in_the_environment_must_be_whole(tmp_path) -> None:
    assert EtcdTls.from_env({}) is None
    with pytest.raises(ValueError, match=CA_ENV):
        EtcdTls.from_env({CERT_ENV: "c", KEY_ENV: "k"})
    ca = TestCa(tmp_path)
    with pytest.raises(ValueError, match="both"):
        EtcdTls.from_env({CA_ENV: str(ca.ca_file), CERT_ENV: str(ca.ca_file)})
    assert EtcdTls.from_env({CA_ENV: str(ca.ca_file)}) == EtcdTls(ca.ca_file.read_bytes())


async def test_the_operators_health_check_of_a_tls_etcd(tls_etcd, tmp_path) -> None:
    """A managed etcd: plain /health on its metrics port (the operator holds no certificate of
    the DisaggServing's). An external one: /health over HTTPS with the operator's own client
    certificate (--etcd-tls-dir); without one, or with another CA's, it is not healthy."""
    etcd, ca = tls_etcd
    assert etcd.tls is not None and etcd.tls.metrics_port
    endpoints = (etcd.endpoint,)
    managed = EtcdHealthChecker(timeout=2, ttl=0, address_overrides={
        f"127.0.0.1:{ETCD_METRICS_PORT}": f"127.0.0.1:{etcd.tls.metrics_port}"})
    health = await managed.check(endpoints, "metrics")
    assert health.healthy, health.message
    own = EtcdHealthChecker(timeout=2, ttl=0, tls_dir=ca.issue("operator", server=False))
    health = await own.check(endpoints, "https")
    assert health.healthy, health.message
    # The controls.
    missing = await EtcdHealthChecker(timeout=2, ttl=0).check(endpoints, "https")
    assert not missing.healthy and "etcdClientTLS.secretName" in missing.message
    stranger = TestCa(tmp_path / "other-pki", "other-ca").issue("stranger", server=False)
    (stranger / "ca.crt").write_bytes(ca.ca_file.read_bytes())  # trusts etcd; etcd does not
    refused = await EtcdHealthChecker(timeout=2, ttl=0, tls_dir=stranger).check(endpoints,
                                                                                 "https")
    assert not refused.healthy, refused.message
    plaintext = await EtcdHealthChecker(timeout=2, ttl=0).check(endpoints)
    assert not plaintext.healthy
