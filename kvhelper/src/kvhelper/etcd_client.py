"""etcd v3 clients for kvhelper's processes (registrar, proxy discovery, peer check), over TLS
when the DisaggServing's etcd requires it.

TLS material comes from files named in the environment, mounted from the Secret that
`spec.etcd.tls.clientSecret` names (cert-manager's layout: ca.crt, tls.crt, tls.key):
KVHELPER_ETCD_CA_FILE (required for TLS), KVHELPER_ETCD_CERT_FILE and KVHELPER_ETCD_KEY_FILE
(the client certificate, for an etcd with --client-cert-auth).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import aetcd
import grpc
from aetcd import rpc, watcher

CA_ENV, CERT_ENV, KEY_ENV = ("KVHELPER_ETCD_CA_FILE", "KVHELPER_ETCD_CERT_FILE",
                             "KVHELPER_ETCD_KEY_FILE")


@dataclass(frozen=True)
class EtcdTls:
    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> EtcdTls | None:
        """The TLS files the environment names; None when it names none (plaintext etcd)."""
        ca, cert, key = (env.get(name) for name in (CA_ENV, CERT_ENV, KEY_ENV))
        if not ca:
            if cert or key:
                raise ValueError(f"{CERT_ENV} and {KEY_ENV} need {CA_ENV} too")
            return None
        if bool(cert) != bool(key):
            raise ValueError(f"set both {CERT_ENV} and {KEY_ENV}, or neither")
        return cls(Path(ca).read_bytes(), Path(cert).read_bytes() if cert else None,
                   Path(key).read_bytes() if key else None)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)


def etcd_client(host: str, port: int, timeout: int = 5,
                tls: EtcdTls | None = None) -> aetcd.Client:
    """A client of one etcd member: plaintext, or TLS when `tls` is given."""
    if tls is None:
        return aetcd.Client(host=host, port=port, timeout=timeout)
    return _TlsClient(host=host, port=port, timeout=timeout, credentials=tls.credentials())


class _TlsClient(aetcd.Client):  # type: ignore[misc]
    """aetcd 1.0 opens only plaintext channels: this opens a TLS one and sets up the same stubs
    (what aetcd's own `connect` does, without its username/password authentication, which
    kvhelper does not use). Replace it when aetcd takes channel credentials."""

    def __init__(self, *, host: str, port: int, timeout: int,
                 credentials: grpc.ChannelCredentials) -> None:
        super().__init__(host=host, port=port, timeout=timeout)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set() or self._is_connecting:
            await super().connect()  # connected, or another task is connecting: it waits
            return
        self.channel = grpc.aio.secure_channel(f"{self._host}:{self._port}",
                                               self._credentials, options=self._options.items())
        self.kvstub = rpc.KVStub(self.channel)
        self.clusterstub = rpc.ClusterStub(self.channel)
        self.leasestub = rpc.LeaseStub(self.channel)
        self.maintenancestub = rpc.MaintenanceStub(self.channel)
        self._watcher = watcher.Watcher(rpc.WatchStub(self.channel), timeout=self._timeout,
                                        metadata=self.metadata)
        self._connected.set()
