"""Prefill TP a → decode TP b: which source page slices feed each destination rank."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from kvhelper.layout import describe_kv_caches
from kvhelper.tp import (
    HeadSlice,
    TPMismatchError,
    heads_of_rank,
    page_byte_ranges,
    plan_tp_transfer,
)

from .conftest import gqa_spec, mla_spec, shared_caches

BLOCK, HEAD_DIM = 16, 8


def test_vllm_head_assignment() -> None:
    assert [heads_of_rank(8, 4, r) for r in range(4)] == [range(0, 2), range(2, 4),
                                                          range(4, 6), range(6, 8)]
    # Fewer heads than ranks: replicated, ranks 0-1 hold head 0, ranks 2-3 head 1.
    assert [heads_of_rank(2, 4, r) for r in range(4)] == [range(0, 1)] * 2 + [range(1, 2)] * 2
    with pytest.raises(TPMismatchError, match="do not split"):
        heads_of_rank(6, 4, 0)


def test_mla_is_read_from_the_one_rank_agnostic_page_for_any_tp() -> None:
    layout = describe_kv_caches(shared_caches((4, 16, 576), 1), mla_spec())
    plan = plan_tp_transfer(layout, src_tp=8, dst_tp=2)
    assert plan == {0: [HeadSlice(-1, 0, 0, 1)], 1: [HeadSlice(-1, 0, 0, 1)]}
    assert page_byte_ranges(layout, plan[0][0], 1) == [(0, 0, layout.page_bytes)]


def test_interleaved_heads_refuse_a_tp_change() -> None:
    layout = describe_kv_caches(shared_caches((4, 2, 16, 2, 64), 1), gqa_spec(), num_blocks=4)
    assert plan_tp_transfer(layout, 2, 2)  # equal TP: pages move whole
    with pytest.raises(TPMismatchError, match="prefill TP 2 and decode TP 4"):
        plan_tp_transfer(layout, 2, 4)


def head_major_page(heads: list[int]) -> torch.Tensor:
    """A packed page (H, N, 2D) whose every byte records which global head it belongs to."""
    page = torch.empty(len(heads), BLOCK, 2 * HEAD_DIM, dtype=torch.uint8)
    for index, head in enumerate(heads):
        page[index] = head
    return page



@settings(max_examples=80, deadline=None)
@given(total=st.sampled_from([1, 2, 4, 8]), src_tp=st.sampled_from([1, 2, 4, 8]),
       dst_tp=st.sampled_from([1, 2, 4, 8]))
def test_destination_pages_hold_exactly_their_heads(total, src_tp, dst_tp) -> None:
    src_pages = {r: head_major_page(list(heads_of_rank(total, src_tp, r)))
                 for r in range(src_tp)}
    dst_spec = gqa_spec(heads=total, head_dim=HEAD_DIM, block=BLOCK, tp=dst_tp)
    dst_heads = dst_spec.kv_heads_per_rank
    layout = describe_kv_caches(
        {"l": torch.zeros(2, dst_heads, BLOCK, 2 * HEAD_DIM, dtype=torch.uint8)}, dst_spec)
    src_heads = max(1, total // src_tp)
    for dst_rank, slices in plan_tp_transfer(layout, src_tp, dst_tp).items():
        page = torch.full((layout.page_bytes,), 255, dtype=torch.uint8)
        for head_slice in slices:
            src = src_pages[head_slice.src_rank].reshape(-1)
            for s, d, n in page_byte_ranges(layout, head_slice, src_heads):
                page[d:d + n] = src[s:s + n]
        assert torch.equal(page.view(dst_heads, BLOCK, -1),
                           head_major_page(list(heads_of_rank(total, dst_tp, dst_rank))))
