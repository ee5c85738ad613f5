"""Gather a request's pages into one transfer buffer and scatter them back, vectorised.

Buffer format (kvhelper FORMAT_VERSION 1): layer-major, then block in the order given, then the
page's regions in layout order: `[layer][block][region 0 | region 1 ...]`. Pages are copied as
bytes, so fp8 and packed K/V data are never converted. One `index_select`/`index_copy_` per layer
(or one for all layers when they tile one storage): no per-token or per-block Python loops.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from kvhelper.layout import KVCacheLayout, LayoutError, Region


class PageMover:
    """Byte views over registered cache tensors, built once and reused for every request."""

    def __init__(self, layout: KVCacheLayout, kv_caches: Mapping[str, torch.Tensor]) -> None:
        if tuple(kv_caches) != layout.layer_names:
            raise LayoutError("the cache tensors do not match the layout's layers")
        self.layout = layout
        self.device = next(iter(kv_caches.values())).device
        # [layer][region] -> uint8 view of shape (num_blocks, region bytes)
        self._views = [[_region_view(t, r, layout.num_blocks) for r in layout.regions]
                       for t in kv_caches.values()]
        # When every layer tiles one storage evenly and a page is one region: a single
        # (layers, blocks, page bytes) view moves all layers in one kernel.
        self._all_layers: torch.Tensor | None = None
        first = next(iter(kv_caches.values()))
        if layout.layer_stride is not None and len(layout.regions) == 1:
            region = layout.regions[0]
            self._all_layers = _byte_view(
                first, region.offset,
                (layout.num_layers, layout.num_blocks, region.nbytes),
                (layout.layer_stride, region.block_stride, 1))

    def nbytes(self, num_pages: int) -> int:
        """Buffer bytes for `num_pages` blocks of every layer."""
        return num_pages * self.layout.page_bytes * self.layout.num_layers

    def block_index(self, block_ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        index = torch.as_tensor(block_ids, dtype=torch.long, device=self.device).reshape(-1)
        if index.numel() and (int(index.min()) < 0 or int(index.max()) >= self.layout.num_blocks):
            raise IndexError(f"block ids must lie in [0, {self.layout.num_blocks}); "
                             f"got {index.min().item()}..{index.max().item()}")
        return index

    def _buffer_view(self, buffer: torch.Tensor, pages: int) -> torch.Tensor:
        needed = self.nbytes(pages)
        if buffer.dtype != torch.uint8 or not buffer.is_contiguous():
            raise ValueError("the transfer buffer must be a contiguous uint8 tensor")
        if buffer.numel() < needed:
            raise ValueError(f"the transfer buffer holds {buffer.numel()} bytes; {pages} pages "
                             f"x {self.layout.num_layers} layers need {needed}")
        return buffer[:needed].view(self.layout.num_layers, pages, self.layout.page_bytes)

    def gather(self, block_ids: Sequence[int] | torch.Tensor,
               buffer: torch.Tensor | None = None) -> torch.Tensor:
        """Copy the pages of `block_ids` (all layers) into `buffer` (allocated if None)."""
        index = self.block_index(block_ids)
        pages = index.numel()
        if buffer is None:
            buffer = torch.empty(self.nbytes(pages), dtype=torch.uint8, device=self.device)
        out = self._buffer_view(buffer, pages)
        if self._all_layers is not None:
            torch.index_select(self._all_layers, 1, index, out=out)
            return buffer
        for layer, views in enumerate(self._views):
            if len(views) == 1:
                torch.index_select(views[0], 0, index, out=out[layer])
                continue
            start = 0
            for view in views:
                width = view.shape[1]
                out[layer, :, start:start + width] = view.index_select(0, index)
                start += width
        return buffer

    def scatter(self, block_ids: Sequence[int] | torch.Tensor, buffer: torch.Tensor) -> None:
        """Write pages from `buffer` (as `gather` laid them out) into `block_ids`."""
        index = self.block_index(block_ids)
        if index.unique().numel() != index.numel():
            raise ValueError("block ids to scatter into must be distinct")
        pages = index.numel()
        src = self._buffer_view(buffer, pages)
        if self._all_layers is not None:
            self._all_layers.index_copy_(1, index, src)
            return
        for layer, views in enumerate(self._views):
            start = 0
            for view in views:
                width = view.shape[1]
                view.index_copy_(0, index, src[layer, :, start:start + width])
                start += width


def _byte_view(tensor: torch.Tensor, offset: int, size: tuple[int, ...],
               stride: tuple[int, ...]) -> torch.Tensor:
    """A uint8 view into `tensor`'s storage, `offset` bytes after its first element."""
    base = tensor.storage_offset() * tensor.element_size() + offset
    view = torch.empty(0, dtype=torch.uint8, device=tensor.device)
    view.set_(tensor.untyped_storage(), base, size, stride)
    return view


def _region_view(tensor: torch.Tensor, region: Region, num_blocks: int) -> torch.Tensor:
    return _byte_view(tensor, region.offset, (num_blocks, region.nbytes), (region.block_stride, 1))
