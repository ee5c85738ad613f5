"""The registrar: runs beside one vLLM server and keeps its etcd registration in step with its
health. It registers once `/health` answers 200, under a lease it keeps alive; it withdraws the
registration after `--unhealthy-after` failed checks (or `--late-grace` seconds of checks answered
late: busy is not down) and on SIGTERM, marking it as withdrawing before deleting it. A crashed
pod stops renewing and its key expires with the lease TTL; the proxy keeps such an instance only
while it answers its health checks (kvhelper.discovery), so nobody needs to clean up.

    python -m kvhelper.registry --role prefill --url http://10.0.0.7:8000 \\
        --health-url http://127.0.0.1:8000/health --model M --etcd etcd:2379 \\
        --prefix /disagg/ns/name/instances/
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from typing import Literal

import aetcd
import aiohttp

from kvhelper.etcd_client import EtcdTls, etcd_client
from kvhelper.instances import ROLES, Instance, split_endpoints

log = logging.getLogger("kvhelper.registry")


Health = Literal["ok", "late", "failed"]


@dataclass(frozen=True)
class RegistrarConfig:
    instance: Instance
    health_url: str
    etcd: list[tuple[str, int]]
    prefix: str
    ttl: int = 10
    interval: float = 2.0  # between health checks and lease renewals
    unhealthy_after: int = 3  # consecutive failed checks before withdrawing
    # A check that times out says "busy", not "down": withdraw only after this long of them.
    late_grace: float = 30.0
    tls: EtcdTls | None = None  # from the environment (kvhelper.etcd_client)


class Registrar:
    def __init__(self, config: RegistrarConfig) -> None:
        self.config = config
        self.key = config.instance.key(config.prefix).encode()
        self.registered = asyncio.Event()
        self._lease: aetcd.Lease | None = None
        self._client: aetcd.Client | None = None
        self._endpoint = 0  # index into config.etcd of the member in use

    async def _etcd(self) -> aetcd.Client:
        if self._client is None:
            host, port = self.config.etcd[self._endpoint]
            self._client = etcd_client(host, port, tls=self.config.tls)
        return self._client

    async def _next_endpoint(self) -> None:
        """Give up on the member in use: the next attempt goes to the next `--etcd` endpoint."""
        client, self._client = self._client, None
        self._endpoint = (self._endpoint + 1) % len(self.config.etcd)
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    async def _health(self, session: aiohttp.ClientSession) -> Health:
        try:
            async with session.get(self.config.health_url) as response:
                return "ok" if response.status == 200 else "failed"
        except TimeoutError:
            return "late"
        except aiohttp.ClientError:
            return "failed"

    async def register(self) -> None:
        client = await self._etcd()
        self._lease = await client.lease(self.config.ttl)
        await client.put(self.key, self.config.instance.to_json(), lease=self._lease)
        self.registered.set()
        log.info("registered %s as %s", self.key.decode(), self.config.instance.url)

    async def withdraw(self) -> None:
        lease, self._lease = self._lease, None
        self.registered.clear()
        if lease is None:
            return
        try:
            # Marked first, so that the proxy drops it at once: a registration that just
            # disappears may be a lease that expired while etcd stalled.
            marked = dataclasses.replace(self.config.instance, withdrawing=True)
            await (await self._etcd()).put(self.key, marked.to_json(), lease=lease)
            await lease.revoke()  # deletes the key with it
            log.info("withdrew %s", self.key.decode())
        except Exception as err:  # etcd gone: the lease expires on its own
            log.warning("could not revoke the lease (%s); it expires in %ss", err,
                        self.config.ttl)

    async def _renew(self) -> bool:
        """Keep the lease alive; False when it is gone (expired, or etcd lost it)."""
        if self._lease is None:
            return False
        try:
            reply = await self._lease.refresh()
        except Exception as err:
            log.warning("lease renewal failed: %s", err)
            return False
        return bool(reply is not None and reply.TTL > 0)

    async def run(self, stop: asyncio.Event) -> None:
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.config.interval))
        failures = 0
        late_since: float | None = None
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not stop.is_set():
                health = await self._health(session)
                now = time.monotonic()
                if health == "late":
                    late_since = now if late_since is None else late_since
                else:
                    late_since = None
                if health == "ok":
                    failures = 0
                    if self._lease is None or not await self._renew():
                        try:
                            await self.register()
                        except Exception as err:
                            self._lease = None
                            log.warning("cannot register in etcd at %s:%s yet: %s",
                                        *self.config.etcd[self._endpoint], err)
                            await self._next_endpoint()
                else:
                    failures += health == "failed"
                    late = late_since is not None and now - late_since >= self.config.late_grace
                    if (failures >= self.config.unhealthy_after or late) \
                            and self._lease is not None:
                        log.warning("%s %s: withdrawing", self.config.health_url,
                                    f"answered late for {now - late_since:.0f} s"
                                    if late and late_since is not None
                                    else f"unhealthy {failures} times")
                        await self.withdraw()
                    elif self._lease is not None:
                        await self._renew()
                try:
                    await asyncio.wait_for(stop.wait(), self.config.interval)
                except TimeoutError:
                    pass
        await self.withdraw()
        if self._client is not None:
            await self._client.close()


def parse_args(argv: list[str] | None = None) -> RegistrarConfig:
    parser = argparse.ArgumentParser(description="Register a vLLM instance in etcd while healthy.")
    parser.add_argument("--role", required=True, choices=ROLES)
    parser.add_argument("--url", required=True, help="The instance's URL as others reach it.")
    parser.add_argument("--health-url", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--etcd", required=True, help="host:port[,host:port...]")
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--fingerprint", default=os.environ.get("KVHELPER_FINGERPRINT", ""))
    parser.add_argument("--id", default=os.environ.get("POD_NAME") or socket.gethostname())
    parser.add_argument("--ttl", type=int, default=10)
    parser.add_argument("--interval", type=float, default=2.0)
    parser.add_argument("--unhealthy-after", type=int, default=3)
    parser.add_argument("--late-grace", type=float, default=30.0,
                        help="Seconds of health checks answered late (busy, not down) "
                             "before withdrawing.")
    args = parser.parse_args(argv)
    try:
        etcd = split_endpoints(args.etcd)
    except ValueError as err:
        parser.error(f"--etcd: {err}")
    if args.ttl < 2 or args.interval >= args.ttl:
        parser.error("--interval must be shorter than --ttl (and --ttl at least 2 s)")
    instance = Instance(id=args.id, role=args.role, url=args.url.rstrip("/"), model=args.model,
                        fingerprint=args.fingerprint)
    try:
        tls = EtcdTls.from_env()
    except (OSError, ValueError) as err:
        parser.error(f"etcd TLS: {err}")
    return RegistrarConfig(instance=instance, health_url=args.health_url, etcd=etcd,
                           prefix=args.prefix, ttl=args.ttl, interval=args.interval,
                           unhealthy_after=args.unhealthy_after, late_grace=args.late_grace,
                           tls=tls)


async def _main(config: RegistrarConfig) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await Registrar(config).run(stop)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    asyncio.run(_main(parse_args(argv)))


if __name__ == "__main__":
    main()
