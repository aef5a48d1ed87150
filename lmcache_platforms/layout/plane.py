"""One paged buffer described by bytes and strides, so every KV layout looks the same to a kernel."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class PlaneGeometry:
    """Byte geometry of a paged buffer; addresses are relative to the plane's first byte.

    Byte ``i`` of segment ``s`` of row ``r`` of block ``b`` lives at
    ``b * block_stride + r * row_stride + s * segment_stride + i``.
    A row is what one slot addresses; its payload is ``segments * segment_bytes`` bytes.
    """

    num_blocks: int
    block_stride: int
    rows_per_block: int
    row_stride: int
    segments: int
    segment_bytes: int
    segment_stride: int

    @property
    def row_bytes(self) -> int:
        """Payload bytes of one row (what a chunk stores for it)."""
        return self.segments * self.segment_bytes

    @property
    def num_slots(self) -> int:
        """Slots this plane can address: ``[0, num_slots)``."""
        return self.num_blocks * self.rows_per_block

    @property
    def span_bytes(self) -> int:
        """Bytes from the plane's first byte to one past its last payload byte."""
        last = (
            (self.num_blocks - 1) * self.block_stride
            + (self.rows_per_block - 1) * self.row_stride
            + (self.segments - 1) * self.segment_stride
            + self.segment_bytes
        )
        return last if self.num_blocks and self.rows_per_block and self.segments else 0

    def byte_address(self, slot: int, segment: int, byte: int) -> int:
        """Relative byte address of one payload byte (the element-by-element oracle)."""
        block, row = divmod(slot, self.rows_per_block)
        return block * self.block_stride + row * self.row_stride + segment * self.segment_stride + byte


@dataclass(frozen=True)
class Plane:
    """A paged buffer of one layer that one KV-cache group addresses by slot.

    ``storage`` is a flat uint8 tensor over the whole underlying allocation (shared by every plane carved
    from it) or None when the plane is only planned (layout files without tensors); ``offset`` is the byte
    offset of block 0, row 0, segment 0 in it. ``pages_only``: the block's rows are all in its page, but not
    where the geometry says (vLLM's CPU AMX tiles): only a whole block page may be moved, never one row.
    """

    layer: str
    name: str
    group: int
    dtype: torch.dtype
    geometry: PlaneGeometry
    offset: int = 0
    storage: torch.Tensor | None = field(default=None, compare=False, repr=False)
    pages_only: bool = False

    @property
    def row_bytes(self) -> int:
        return self.geometry.row_bytes

    def allocation_address(self) -> int:
        """Address of the first byte of the allocation behind the plane (not of the plane itself)."""
        if self.storage is None:
            raise ValueError(f"plane {self.name!r} of layer {self.layer!r} has no tensor behind it")
        return self.storage.untyped_storage().data_ptr()

    def rows_view(self) -> torch.Tensor:
        """A ``[num_blocks, rows_per_block, segments, segment_bytes]`` uint8 view of the plane's bytes."""
        if self.storage is None:
            raise ValueError(f"plane {self.name!r} of layer {self.layer!r} has no tensor behind it")
        g = self.geometry
        return self.storage.as_strided(
            (g.num_blocks, g.rows_per_block, g.segments, g.segment_bytes),
            (g.block_stride, g.row_stride, g.segment_stride, 1),
            self.offset,
        )


def buffer_bytes(planes: Sequence[Plane], rows: int) -> int:
    """Size of the chunk buffer for ``rows`` rows: plane-major, plane ``p`` holds ``rows x row_bytes_p``.

    The one definition of a transfer's byte count: transfer groups, chunk formats and kernel checks use it.
    """
    return rows * sum(p.row_bytes for p in planes)
