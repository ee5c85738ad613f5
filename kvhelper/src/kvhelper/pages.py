"""Gather a request's pages into one transfer buffer and scatter them back, vectorised.

Buffer formats (kvhelper FORMAT_VERSION 1), pages copied as bytes (fp8 and packed K/V data are
never converted):
- `order="layer"`: `[layer][block][region 0 | region 1 ...]`, blocks in the order given;
- `order="block"`: `[block][layer][regions]`: each block's pages of every layer are one
  contiguous slice, the unit the connector stores under one key.

How: every region of every block of every layer is one *row* of equal width in the storage the
layers share. The rows are viewed as one 2-D tensor (in the widest integer type the alignment
allows, which makes the copy kernels several times faster than on bytes), so a whole request is
a single `index_select` (gather) or `index_copy_` (scatter) with a precomputed row index: no
per-token, per-block or per-layer Python loops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from kvhelper.layout import KVCacheLayout, LayoutError

Order = Literal["layer", "block"]
_WIDE_TYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


@dataclass(frozen=True)
class _RowSpace:
    """Rows of one storage: `rows[base[l, r] + block * step]` is region r of a block of layer l."""

    rows: torch.Tensor  # (num_rows, row_elements) view of the storage
    base: torch.Tensor  # (layers in this storage, regions) row of block 0
    step: int  # rows between consecutive blocks
    layers: tuple[int, ...]  # positions of these layers in the layout


class PageMover:
    """Row views over registered cache tensors, built once and reused for every request."""

    def __init__(self, layout: KVCacheLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if tuple(kv_caches) != layout.layer_names:
            raise LayoutError("the cache tensors do not match the layout's layers")
        widths = {r.nbytes for r in layout.regions}
        strides = {r.block_stride for r in layout.regions}
        if len(widths) != 1 or len(strides) != 1:
            raise LayoutError(f"regions of unequal size or stride: {layout.regions}")
        self.layout = layout
        self.row_bytes = widths.pop()
        tensors = list(kv_caches.values())
        self.device = tensors[0].device
        self.element_bytes, self.dtype = _widest(self.row_bytes, layout, tensors)
        self._spaces = [self._row_space(tensors, group) for group in _storage_groups(tensors)]

    def _row_space(self, tensors: list[torch.Tensor], layers: list[int]) -> _RowSpace:
        layout, row = self.layout, self.row_bytes
        block_stride = layout.regions[0].block_stride
        origin = min(tensors[i].data_ptr() for i in layers)
        starts = []
        for i in layers:
            start = tensors[i].data_ptr() - origin
            offsets = [start + r.offset for r in layout.regions]
            if block_stride % row or any(o % row for o in offsets):
                raise LayoutError(f"layer {layout.layer_names[i]}: pages do not fall on a grid "
                                  f"of {row}-byte rows; cannot move them whole")
            starts.append([o // row for o in offsets])
        last = max(starts[k][-1] for k in range(len(layers)))
        num_rows = last + (layout.num_blocks - 1) * (block_stride // row) + 1
        first = min((tensors[i] for i in layers), key=lambda t: t.data_ptr())
        elements = row // self.element_bytes
        view = torch.empty(0, dtype=self.dtype, device=self.device)
        view.set_(first.untyped_storage(), first.storage_offset() * first.element_size()
                  // self.element_bytes, (num_rows, elements), (elements, 1))
        return _RowSpace(rows=view, base=torch.tensor(starts, dtype=torch.long,
                                                      device=self.device),
                         step=block_stride // row, layers=tuple(layers))

    def nbytes(self, num_pages: int) -> int:
        """Buffer bytes for `num_pages` blocks of every layer."""
        return num_pages * self.layout.page_bytes * self.layout.num_layers

    def block_index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.layout.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.layout.num_blocks}); "
                             f"got {index.min().item()}..{index.max().item()}")
        return index

    def _rows_of(self, space: _RowSpace, index: torch.Tensor, order: Order) -> torch.Tensor:
        # (layers, regions, blocks) -> the buffer's order of rows.
        rows = space.base[:, :, None] + index[None, None, :] * space.step
        dims = (0, 2, 1) if order == "layer" else (2, 0, 1)
        return rows.permute(*dims).reshape(-1)

    def _check_order(self, order: Order) -> None:
        if order == "block" and len(self._spaces) > 1:
            raise LayoutError("block-major buffers need every layer in one storage, as vLLM "
                              "allocates them; these layers live in separate tensors")

    def _buffer_rows(self, buffer: torch.Tensor, pages: int) -> torch.Tensor:
        needed = self.nbytes(pages)
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise ValueError("the transfer buffer must be a contiguous uint8 tensor")
        if buffer.numel() < needed:
            raise ValueError(f"the transfer buffer holds {buffer.numel()} bytes; {pages} pages "
                             f"x {self.layout.num_layers} layers need {needed}")
        if buffer.data_ptr() % self.element_bytes:
            raise ValueError(f"the transfer buffer must be {self.element_bytes}-byte aligned")
        return buffer[:needed].view(self.dtype).view(-1, self.row_bytes // self.element_bytes)

    def _layer_rows(self, rows: torch.Tensor, space: _RowSpace, pages: int) -> torch.Tensor:
        """The buffer rows of the layers in `space` (all of them in the usual single space)."""
        per_layer = pages * len(self.layout.regions)
        if len(space.layers) == self.layout.num_layers:
            return rows
        first, last = space.layers[0], space.layers[-1]
        return rows[first * per_layer:(last + 1) * per_layer]

    def gather(self, block_ids: Sequence[int] | torch.Tensor,
               buffer: torch.Tensor | None = None, order: Order = "layer") -> torch.Tensor:
        """Copy the pages of `block_ids` (all layers) into `buffer` (allocated if None)."""
        self._check_order(order)
        index = self.block_index(block_ids)
        pages = index.numel()
        if buffer is None:
            buffer = torch.empty(self.nbytes(pages), dtype=torch.uint8, device=self.device)
        rows = self._buffer_rows(buffer, pages)
        for space in self._spaces:
            torch.index_select(space.rows, 0, self._rows_of(space, index, order),
                               out=self._layer_rows(rows, space, pages))
        return buffer

    def block_spans(self, block_ids: Sequence[int] | torch.Tensor,
                    heads: tuple[int, int] | None = None) -> list[list[int]]:
        """For each block, the addresses of its pieces in the cache, in `order="block"` buffer
        order: one per layer and region, `piece_bytes(heads)` long. Lets a store read or write
        a block's value straight from or into the cache, with no buffer in between.

        `heads=(first, count)`: only those KV heads of each page (head-major layouts)."""
        self._check_order("block")
        space = self._spaces[0]
        index = self.block_index(block_ids)
        rows = self._rows_of(space, index, "block").reshape(index.numel(), -1)
        addresses = rows * self.row_bytes + (space.rows.data_ptr() + self._head_offset(heads))
        return addresses.tolist()

    def buffer_spans(self, address: int, count: int,
                     heads: tuple[int, int] | None = None) -> list[list[int]]:
        """`block_spans` for `count` blocks laid out in a buffer by `gather(order="block")`."""
        rows = self.layout.num_layers * len(self.layout.regions)
        base = address + self._head_offset(heads)
        return [[base + (block * rows + row) * self.row_bytes for row in range(rows)]
                for block in range(count)]

    def piece_bytes(self, heads: tuple[int, int] | None = None) -> int:
        """Bytes of each piece `block_spans(..., heads)` returns."""
        return self.row_bytes if heads is None else heads[1] * self._head_bytes()

    def _head_bytes(self) -> int:
        if not self.layout.head_major:
            raise LayoutError(f"the {self.layout.kind.value} layout interleaves KV heads inside "
                              "a page, so a page cannot be split by head")
        return self.row_bytes // self.layout.kv_heads

    def _head_offset(self, heads: tuple[int, int] | None) -> int:
        if heads is None:
            return 0
        first, count = heads
        if first < 0 or count < 1 or first + count > self.layout.kv_heads:
            raise IndexError(f"heads {first}..{first + count - 1} are not among this page's "
                             f"{self.layout.kv_heads}")
        return first * self._head_bytes()

    def storage_span(self) -> tuple[int, int]:
        """(address, bytes) of the one storage every layer lives in, for registering it."""
        self._check_order("block")
        rows = self._spaces[0].rows
        return rows.data_ptr(), rows.shape[0] * self.row_bytes

    def scatter(self, block_ids: Sequence[int] | torch.Tensor, buffer: torch.Tensor,
                order: Order = "layer") -> None:
        """Write pages from `buffer` (as `gather` laid them out) into `block_ids`."""
        self._check_order(order)
        index = self.block_index(block_ids)
        ordered = torch.sort(index).values
        if bool((ordered[1:] == ordered[:-1]).any()):
            raise ValueError("block ids to scatter into must be distinct")
        rows = self._buffer_rows(buffer, index.numel())
        for space in self._spaces:
            space.rows.index_copy_(0, self._rows_of(space, index, order),
                                   self._layer_rows(rows, space, index.numel()))


def _widest(row_bytes: int, layout: KVCacheLayout,
            tensors: list[torch.Tensor]) -> tuple[int, torch.dtype]:
    for size, dtype in _WIDE_TYPES:
        aligned = all(t.data_ptr() % size == 0 for t in tensors) and all(
            r.offset % size == 0 and r.block_stride % size == 0 for r in layout.regions)
        if row_bytes % size == 0 and aligned:
            return size, dtype
    raise AssertionError("unreachable: every row is byte-aligned")


def _storage_groups(tensors: list[torch.Tensor]) -> list[list[int]]:
    """Layer positions grouped by the storage they live in, each group contiguous in order."""
    groups: list[list[int]] = []
    last_storage = None
    for i, tensor in enumerate(tensors):
        storage = tensor.untyped_storage().data_ptr()
        if groups and storage == last_storage:
            groups[-1].append(i)
        else:
            groups.append([i])
        last_storage = storage
    return groups
