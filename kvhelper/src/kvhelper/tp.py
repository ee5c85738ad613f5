"""Tensor parallelism: how K/V pages are split into store values so that prefill and decode
instances with different TP sizes can exchange them.

MLA pages are identical on every rank: one rank-agnostic value per block, whatever the TP sizes.
K/V pages hold the KV heads of one rank (vLLM splits heads evenly over the ranks, or replicates
them when there are fewer heads than ranks). The store holds each block as `shards` values, each
of `total_heads / shards` consecutive heads (vLLM's Mooncake store calls the count
`store_tp_size`). A rank writes and reads the shards of the heads it holds, each shard into its
place among the rank's heads. Two instances exchange pages when they use the same shard count,
whatever their TP sizes, as long as every shard lies inside one rank of each: the count must
divide the number of KV heads and be a multiple of each TP size (up to the head count).

By default the count is the instance's own TP size (capped at the head count), so a rank's page
is one value. A rank that holds several shards splits its page by head, which needs each head's
bytes to be contiguous in the page (a head-major layout, such as vLLM's CPU cache); other
layouts are refused at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass


class TPMismatchError(ValueError):
    """A shard count that these TP sizes and heads cannot use; the message says why."""


def heads_of_rank(total_heads: int, tp_size: int, rank: int) -> range:
    """The global KV heads a rank holds, as vLLM assigns them."""
    if tp_size < 1 or not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in a TP group of {tp_size}")
    if total_heads >= tp_size:
        if total_heads % tp_size:
            raise TPMismatchError(f"{total_heads} KV heads do not split over TP {tp_size}")
        per_rank = total_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % total_heads:
        raise TPMismatchError(f"TP {tp_size} is not a multiple of the {total_heads} KV heads")
    replicas = tp_size // total_heads
    head = rank // replicas
    return range(head, head + 1)


@dataclass(frozen=True)
class StoreSharding:
    """Which store shards of a block one TP rank writes and reads."""

    shards: int  # values per block in the store
    heads_per_shard: int
    first_shard: int  # the rank's shards are first_shard, first_shard + 1, ...
    local_shards: int  # how many the rank holds (its page is split into this many)
    writes: bool  # False for a replica of heads another rank already stores

    @property
    def shard_ids(self) -> range:
        return range(self.first_shard, self.first_shard + self.local_shards)

    def head_offset(self, local_index: int) -> int:
        """Where the rank's `local_index`-th shard starts among its own heads."""
        return local_index * self.heads_per_shard

    def piece_heads(self) -> list[tuple[int, int] | None]:
        """For each of the rank's shards, (first, count) of its heads in the rank's pages;
        [None] when the rank holds one shard: its pages move whole."""
        if self.local_shards == 1:
            return [None]
        return [(self.head_offset(i), self.heads_per_shard) for i in range(self.local_shards)]


def effective_shards(total_heads: int, tp_size: int, requested: int | None) -> int:
    """The shard count an instance uses: `requested` (default: its TP size), capped at the
    number of KV heads (a shard never holds less than one head)."""
    shards = tp_size if requested is None else requested
    if isinstance(shards, bool) or not isinstance(shards, int) or shards < 1:
        raise TPMismatchError(f"store_tp_size must be a positive integer, not {shards!r}")
    return min(shards, total_heads)


def store_sharding(total_heads: int, tp_size: int, rank: int,
                   requested: int | None = None) -> StoreSharding:
    """The shards `rank` of a TP-`tp_size` instance writes and reads; refused with a message
    naming `store_tp_size` when the count cannot work for these heads and TP size."""
    shards = effective_shards(total_heads, tp_size, requested)
    owned = heads_of_rank(total_heads, tp_size, rank)
    if total_heads % shards:
        raise TPMismatchError(
            f"store_tp_size {shards} does not divide the model's {total_heads} KV heads; use a "
            f"divisor of {total_heads} that is a multiple of every instance's TP size")
    per_shard = total_heads // shards
    if len(owned) % per_shard:
        raise TPMismatchError(
            f"store_tp_size {shards} gives shards of {per_shard} heads, but each rank of TP "
            f"{tp_size} holds {len(owned)}: a shard would span ranks; use a multiple of "
            f"{min(tp_size, total_heads)}")
    replicas = max(1, tp_size // total_heads)
    return StoreSharding(shards=shards, heads_per_shard=per_shard,
                         first_shard=owned.start // per_shard,
                         local_shards=len(owned) // per_shard, writes=rank % replicas == 0)
