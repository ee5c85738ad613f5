"""Tensor parallelism: which source page slices feed each destination rank.

MLA pages are identical on every rank, so every destination rank reads the one rank-agnostic
page, whatever the two TP sizes. GQA pages hold the KV heads of one rank (vLLM splits heads
evenly, or replicates them when there are fewer heads than ranks); a destination rank's page is
assembled from the head slices of the source ranks that hold its heads. That needs each head to
be a contiguous run inside a page (a head-major layout); otherwise only equal TP sizes work.
Every unsupported combination is refused before any transfer.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvhelper.layout import KVCacheLayout


class TPMismatchError(ValueError):
    """The prefill and decode TP sizes cannot exchange pages; the message says why."""


@dataclass(frozen=True)
class HeadSlice:
    """Heads [src_head, src_head + num_heads) of `src_rank`'s page go to [dst_head, ...)."""

    src_rank: int  # -1: the rank-agnostic (MLA) page
    src_head: int
    dst_head: int
    num_heads: int


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


def source_rank_for(total_heads: int, tp_size: int, head: int) -> int:
    """The first source rank holding `head` (replicas hold identical data)."""
    if total_heads >= tp_size:
        return head // (total_heads // tp_size)
    return head * (tp_size // total_heads)


def plan_tp_transfer(layout: KVCacheLayout, src_tp: int, dst_tp: int) -> dict[int, list[HeadSlice]]:
    """For each destination rank, the head slices to read, in destination head order."""
    if layout.rank_agnostic:
        return {rank: [HeadSlice(-1, 0, 0, 1)] for rank in range(dst_tp)}
    total = layout.spec.total_kv_heads
    if src_tp != dst_tp and not layout.head_major:
        raise TPMismatchError(
            f"prefill TP {src_tp} and decode TP {dst_tp} differ, and the {layout.kind.value} "
            "layout interleaves heads inside a page; use equal TP sizes")
    plan: dict[int, list[HeadSlice]] = {}
    for dst_rank in range(dst_tp):
        wanted = heads_of_rank(total, dst_tp, dst_rank)
        slices: list[HeadSlice] = []
        for dst_index, head in enumerate(wanted):
            src_rank = source_rank_for(total, src_tp, head)
            src_heads = heads_of_rank(total, src_tp, src_rank)
            src_index = head - src_heads.start
            last = slices[-1] if slices else None
            if last and last.src_rank == src_rank and \
                    last.src_head + last.num_heads == src_index and \
                    last.dst_head + last.num_heads == dst_index:
                slices[-1] = HeadSlice(src_rank, last.src_head, last.dst_head,
                                       last.num_heads + 1)
            else:
                slices.append(HeadSlice(src_rank, src_index, dst_index, 1))
        plan[dst_rank] = slices
    return plan


def page_byte_ranges(layout: KVCacheLayout, head_slice: HeadSlice,
                     src_heads_per_rank: int) -> list[tuple[int, int, int]]:
    """(source byte offset, destination byte offset, length) inside one page, per region.

    Source pages hold `src_heads_per_rank` heads, destination pages `layout.kv_heads`.
    """
    if head_slice.src_rank == -1:
        return [(0, 0, layout.page_bytes)]
    ranges = []
    src_base = dst_base = 0
    for region in layout.regions:
        per_head = region.nbytes // layout.kv_heads
        ranges.append((src_base + head_slice.src_head * per_head,
                       dst_base + head_slice.dst_head * per_head,
                       head_slice.num_heads * per_head))
        src_base += per_head * src_heads_per_rank
        dst_base += region.nbytes
    return ranges
