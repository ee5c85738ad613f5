"""Registrations in a real etcd follow instance health; the proxy's view follows etcd."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aetcd
import pytest
from disagg_devtools.etcd_process import EtcdProcess
from disagg_devtools.processes import free_port
from disagg_devtools.waiting import wait_for
from kvhelper.discovery import EtcdDiscovery
from kvhelper.instances import Instance
from kvhelper.registry import Registrar, RegistrarConfig

from .fake_vllm import FakeVLLM

PREFIX = "/disagg/test/dsv/instances/"


@pytest.fixture
async def etcd(tmp_path: Path) -> AsyncIterator[EtcdProcess]:
    proc = await EtcdProcess(tmp_path / "etcd").start()
    yield proc
    proc.stop()


class Background:
    """Tasks started by a test, cancelled at its end."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[Any]] = []

    def start(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro)
        self.tasks.append(task)
        return task

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task


@pytest.fixture
async def background() -> AsyncIterator[Background]:
    tasks = Background()
    yield tasks
    await tasks.close()


def registrar_for(fake: FakeVLLM, role: str, etcd: EtcdProcess, ttl: int = 2,
                  endpoints: list[tuple[str, int]] | None = None,
                  late_grace: float = 30.0) -> Registrar:
    instance = Instance(id=fake.name, role=role, url=fake.url, model="tiny",  # type: ignore[arg-type]
                        fingerprint="fp1")
    return Registrar(RegistrarConfig(
        instance=instance, health_url=f"{fake.url}/health",
        etcd=endpoints or [("127.0.0.1", etcd.client_port)], prefix=PREFIX, ttl=ttl,
        interval=0.2, unhealthy_after=2, late_grace=late_grace))


def follow(etcd: EtcdProcess, background: Background,
           endpoints: list[tuple[str, int]] | None = None,
           lapse_grace: float = 30.0) -> dict[str, Instance]:
    view: dict[str, Instance] = {}

    def update(instances: dict[str, Instance]) -> None:
        view.clear()
        view.update(instances)

    discovery = EtcdDiscovery(endpoints or [("127.0.0.1", etcd.client_port)], PREFIX,
                              backoff=(0.1, 0.2, 0.5), lapse_grace=lapse_grace)
    background.start(discovery.run(update, asyncio.Event()))
    return view


def urls(view: dict[str, Instance]) -> set[str]:
    return {i.url for i in view.values()}


async def test_registration_follows_health_and_stop(etcd, background) -> None:
    fake = await FakeVLLM("d0", healthy=False).start()
    try:
        view = follow(etcd, background)
        stop = asyncio.Event()
        registrar = background.start(registrar_for(fake, "decode", etcd).run(stop))
        await asyncio.sleep(0)
        assert view == {}  # not registered while /health fails
        fake.healthy = True
        await wait_for(lambda: urls(view) == {fake.url}, 10, "the registration")
        (instance,) = view.values()
        assert (instance.role, instance.fingerprint) == ("decode", "fp1")
        fake.healthy = False
        await wait_for(lambda: view == {}, 10, "withdrawal after failed health checks")
        fake.healthy = True
        await wait_for(lambda: urls(view) == {fake.url}, 10, "re-registration")
        stop.set()  # SIGTERM in the CLI
        await asyncio.wait_for(registrar, 10)
        await wait_for(lambda: view == {}, 2, "withdrawal on stop (revoked, not expired)")
    finally:
        await fake.stop()


async def test_an_instance_that_answers_its_health_checks_late_stays_registered_for_a_while(
        etcd, background) -> None:
    """Found running the pods as containers on 2 cores: while one instance restarted, the
    others answered /health late and their registrars withdrew them, one after another, so
    the proxy lost instances that were serving. A late answer is not a failed one: it
    withdraws only after `late_grace` seconds of them; a refusal or an error answer withdraws
    after `unhealthy_after` checks, as before."""
    fake = await FakeVLLM("d0").start()
    try:
        view = follow(etcd, background)
        background.start(registrar_for(fake, "decode", etcd, late_grace=3.0).run(
            asyncio.Event()))
        await wait_for(lambda: urls(view) == {fake.url}, 10, "the registration")
        fake.health_delay = 1.5  # past the check's 1 s timeout
        late_since = asyncio.get_running_loop().time()
        for _ in range(10):  # 2 s: ten checks, five times unhealthy_after
            await asyncio.sleep(0.2)
            assert urls(view) == {fake.url}, "withdrawn for answering late"
        await wait_for(lambda: view == {}, 10, "withdrawal after late_grace")
        assert asyncio.get_running_loop().time() - late_since >= 3.0
    finally:
        await fake.stop()


async def test_an_expired_registration_stays_a_while_and_a_withdrawn_one_leaves_at_once(
        etcd, background) -> None:
    """Found running the pods as containers: etcd stalled for seconds (a slow fdatasync on 2
    cores), a surviving decode's lease expired, and the proxy answered 503 "no healthy decode"
    for 7 s while that decode was serving. A registration that expires (its registrar could
    not renew) is not a withdrawal: the view keeps it for `lapse_grace` seconds, while the
    proxy's own health checks judge the instance, and a re-registration takes its place. A
    withdrawal (drain, SIGTERM, unhealthy) marks the key first and leaves at once."""
    fake = await FakeVLLM("p0").start()
    try:
        view = follow(etcd, background, lapse_grace=3.0)
        registrar = background.start(registrar_for(fake, "prefill", etcd, ttl=2).run(
            asyncio.Event()))
        await wait_for(lambda: urls(view) == {fake.url}, 10, "the registration")
        registrar.cancel()  # stops renewing without withdrawing anything
        async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as client:
            key = Instance(id="p0", role="prefill", url="", model="").key(PREFIX).encode()
            expired = time.monotonic() + 10
            while (await client.get(key)) is not None:
                assert time.monotonic() < expired, "the lease never expired"
                await asyncio.sleep(0.1)
        gone = time.monotonic()
        assert urls(view) == {fake.url}, "an expired registration left the view at once"
        stop = asyncio.Event()
        again = background.start(registrar_for(fake, "prefill", etcd).run(stop))
        await wait_for(lambda: urls(view) == {fake.url} and time.monotonic() - gone > 3.5, 10,
                       "a re-registration to replace the lapsed one past its grace")
        stop.set()
        await asyncio.wait_for(again, 10)
        await wait_for(lambda: view == {}, 1, "a withdrawn registration to leave at once")
        background.start(registrar_for(fake, "prefill", etcd, ttl=2).run(asyncio.Event()))
        await wait_for(lambda: urls(view) == {fake.url}, 10, "the third registration")
        background.tasks[-1].cancel()
        await wait_for(lambda: view == {}, 15, "a lapsed registration to leave after its grace")
    finally:
        await fake.stop()


async def test_discovery_and_registration_survive_an_etcd_restart(etcd, background) -> None:
    fake = await FakeVLLM("d0").start()
    try:
        view = follow(etcd, background)
        background.start(registrar_for(fake, "decode", etcd, ttl=5).run(asyncio.Event()))
        await wait_for(lambda: urls(view) == {fake.url}, 10, "the registration")
        etcd.stop()
        await etcd.start()  # same ports and data directory
        async with aetcd.Client(host="127.0.0.1", port=etcd.client_port) as client:
            late = Instance(id="late", role="prefill", url="http://late:8000", model="tiny")
            await client.put(late.key(PREFIX).encode(), late.to_json())
        await wait_for(lambda: urls(view) == {fake.url, "http://late:8000"}, 20,
                       "discovery to reconnect and see both instances")
    finally:
        await fake.stop()


async def test_both_sides_fail_over_to_the_next_etcd_endpoint(etcd, background) -> None:
    """`--etcd a,b`: with member a down, registrar and proxy both carry on through b."""
    endpoints = [("127.0.0.1", free_port()), ("127.0.0.1", etcd.client_port)]  # a: nobody there
    fake = await FakeVLLM("d1").start()
    try:
        view = follow(etcd, background, endpoints)
        registrar = registrar_for(fake, "decode", etcd, ttl=5, endpoints=endpoints)
        background.start(registrar.run(asyncio.Event()))
        await wait_for(lambda: urls(view) == {fake.url}, 30, "registration and discovery via b")
        assert registrar.registered.is_set()
    finally:
        await fake.stop()


@pytest.mark.parametrize(("module", "args", "message"), [
    ("kvhelper.registry", ["--role", "decode", "--url", "u", "--health-url", "h", "--model",
                           "m", "--etcd", "no-port", "--prefix", "/p/"], "--etcd"),
    ("kvhelper.registry", ["--role", "decode", "--url", "u", "--health-url", "h", "--model",
                           "m", "--etcd", "e:1", "--prefix", "/p/", "--ttl", "2",
                           "--interval", "5"], "--interval must be shorter"),
    ("kvhelper.proxy", [], "either --etcd"),
    ("kvhelper.proxy", ["--etcd", "e:1"], "--etcd needs --prefix"),
])
def test_command_lines_refuse_bad_flags(module: str, args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", module, *args], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2
    assert message in result.stderr


async def test_proxy_routes_to_registered_instances_only(etcd, background, backends,
                                                         start_proxy) -> None:
    from kvhelper.discovery import EtcdDiscovery as Discovery

    from .test_proxy import post

    prefill, decode = await backends("p0"), await backends("d0")
    background.start(registrar_for(prefill, "prefill", etcd).run(asyncio.Event()))
    decode_registrar = background.start(registrar_for(decode, "decode", etcd).run(
        asyncio.Event()))
    discovery = Discovery([("127.0.0.1", etcd.client_port)], PREFIX, backoff=(0.1,))
    proxy = await start_proxy([], [], discovery=discovery)

    async def status() -> int:
        return (await post(f"{proxy}/v1/completions", {"prompt": "x"}))[0]

    deadline = time.monotonic() + 10
    while await status() != 200:
        assert time.monotonic() < deadline, "the proxy never saw both registrations"
        await asyncio.sleep(0.1)
    assert decode.requests and decode.requests[-1]["kv_transfer_params"]["remote_engine_id"] \
        == "p0"
    decode_registrar.cancel()  # the decode pod crashes: its registrar and its vLLM
    await decode.stop()
    deadline = time.monotonic() + 10
    while await status() != 503:
        assert time.monotonic() < deadline, "the expired decode stayed in the pool"
        await asyncio.sleep(0.2)


async def test_registrar_process_withdraws_on_sigterm(etcd, background, tmp_path) -> None:
    fake = await FakeVLLM("d9").start()
    view = follow(etcd, background)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvhelper.registry", "--role", "decode", "--url", fake.url,
        "--health-url", f"{fake.url}/health", "--model", "tiny",
        "--etcd", f"127.0.0.1:{etcd.client_port}", "--prefix", PREFIX, "--id", "d9",
        "--ttl", "30", "--interval", "0.2")
    try:
        await wait_for(lambda: urls(view) == {fake.url}, 30, "the registration")
        proc.terminate()
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        # Withdrawn at once, not after the 30 s lease TTL.
        await wait_for(lambda: view == {}, 5, "withdrawal on SIGTERM")
    finally:
        if proc.returncode is None:
            proc.kill()
        await fake.stop()


async def test_the_peer_check_passes_only_once_a_peer_of_the_same_fingerprint_is_registered(
        etcd, background):
    """The registrar's startup probe (kvhelper.peer_check) against a real etcd: a new decode
    instance counts as started only when a prefill instance of its fingerprint is registered,
    not one of the old fingerprint; an etcd it cannot reach is a failure of its own."""
    check = ["--peer-role", "prefill", "--fingerprint", "NEW", "--etcd", etcd.endpoint,
             "--prefix", PREFIX]

    def run(args: list[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "kvhelper.peer_check", *args],
                              capture_output=True, text=True, timeout=30)

    assert run(check).returncode == 1
    async with aetcd.Client(*etcd.endpoint.split(":")) as client:
        for role, name, fingerprint in (("prefill", "old-p", "OLD"), ("decode", "new-d", "NEW")):
            instance = Instance(id=name, role=role, url=f"http://{name}", model="m",
                                fingerprint=fingerprint)
            await client.put(instance.key(PREFIX).encode(), instance.to_json())
        refused = run(check)
        assert refused.returncode == 1 and "1 of other fingerprints" in refused.stdout
        new = Instance(id="new-p", role="prefill", url="http://new-p", model="m",
                       fingerprint="NEW")
        await client.put(new.key(PREFIX).encode(), new.to_json())
    passed = run(check)
    assert passed.returncode == 0, passed.stdout
    unreachable = run([*check[:5], f"127.0.0.1:{free_port()}", *check[6:], "--timeout", "1"])
    assert unreachable.returncode == 2 and "cannot ask etcd" in unreachable.stdout
