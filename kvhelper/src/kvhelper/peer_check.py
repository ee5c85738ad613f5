"""Is a peer of this instance's fingerprint registered? The registrar container's startup probe.

A pod counts as ready (and a rollout retires an old pod for it) only once the other role has
an instance registered with the same KV compatibility fingerprint: a new prefill instance is
worth nothing until a new decode instance can take its KV, and the reverse. So during a rollout
that changes the fingerprint, the old prefill and decode instances keep serving until new ones
of *both* roles serve, and a revision that cannot start in one role never retires the other
role's old instances. Checked once per probe; never run again after it first succeeds.

    python -m kvhelper.peer_check --peer-role decode --fingerprint F \\
        --etcd etcd:2379 --prefix /disagg/ns/name/instances/

Exit status 0: found; 1: not (yet); 2: etcd could not be asked.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from kvhelper.etcd_client import EtcdTls, etcd_client
from kvhelper.instances import ROLES, Instance, split_endpoints


async def registered_fingerprints(endpoints: list[tuple[str, int]], prefix: str, role: str,
                                  timeout: float, tls: EtcdTls | None = None) -> list[str]:
    """The fingerprints of `role`'s registered instances, from the first member that answers."""
    last: Exception | None = None
    for host, port in endpoints:
        try:
            async with etcd_client(host, port, int(max(1, timeout)), tls) as client:
                found = await client.get_prefix(f"{prefix}{role}/".encode())
                fingerprints = []
                for kv in found:
                    try:
                        peer = Instance.from_json(kv.value)
                    except (ValueError, KeyError):
                        continue  # a malformed registration is nobody's peer
                    if not peer.withdrawing:  # leaving: no new pod may count on it
                        fingerprints.append(peer.fingerprint)
                return fingerprints
        except Exception as err:  # grpc/aetcd raise many types; all mean "try the next"
            last = err
    raise ConnectionError(f"no etcd member answered: {last}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer-role", required=True, choices=ROLES)
    parser.add_argument("--fingerprint", required=True)
    parser.add_argument("--etcd", required=True, help="host:port[,host:port...]")
    parser.add_argument("--prefix", required=True)
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        args.endpoints = split_endpoints(args.etcd)
    except ValueError as err:
        parser.error(f"--etcd: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        found = asyncio.run(registered_fingerprints(args.endpoints, args.prefix, args.peer_role,
                                                    args.timeout, EtcdTls.from_env()))
    except (ConnectionError, OSError, ValueError) as err:
        print(f"cannot ask etcd: {err}")
        return 2
    if args.fingerprint in found:
        print(f"a {args.peer_role} instance of fingerprint {args.fingerprint} is registered")
        return 0
    print(f"no {args.peer_role} instance of fingerprint {args.fingerprint} is registered yet "
          f"({len(found)} of other fingerprints)")
    return 1


if __name__ == "__main__":
    sys.exit(main())
