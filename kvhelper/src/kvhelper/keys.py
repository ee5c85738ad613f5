"""Store keys for KV pages: content-addressed, so shared prefixes are stored once.

A block's key is derived from vLLM's chained block hash (which covers every token up to and
including the block), namespaced by the compatibility fingerprint so incompatible instances can
never read each other's pages. MLA pages are rank-agnostic: one key for every TP rank. K/V pages
carry their head shard: `tp<shards>r<shard>` (see `kvhelper.tp`; by default the shards are the
TP ranks).
"""

from __future__ import annotations

from kvhelper import FORMAT_VERSION


def block_key(fingerprint: str, block_hash: bytes | str, shard: tuple[int, int] | None = None
              ) -> str:
    """`kvh<format>/<fingerprint>/<hash hex>[/tp<shards>r<shard>]`; shard None = rank-agnostic."""
    digest = block_hash.hex() if isinstance(block_hash, bytes) else str(block_hash)
    key = f"kvh{FORMAT_VERSION}/{fingerprint}/{digest}"
    if shard is not None:
        size, rank = shard
        key += f"/tp{size}r{rank}"
    return key
