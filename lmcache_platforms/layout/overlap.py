"""Byte-overlap checks for the planes of one layer: two planes writing the same byte corrupt each other.

A plane whose strides nest (each one at least the extent of the smaller ones) cannot overlap itself, which
settles real layouts without enumerating anything. Otherwise, and for two planes whose spans meet, byte
addresses are enumerated in a window of a few blocks from where they start meeting: layouts repeat per
block, so that catches every real mistake (a wrong hint, a wrong kv split, K and V aliasing) without
enumerating a multi-gigabyte pool.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.plane import Plane

MIN_WINDOW = 1 << 16
MAX_WINDOW = 1 << 22


def _block_span(plane: Plane) -> int:
    g = plane.geometry
    return (g.rows_per_block - 1) * g.row_stride + (g.segments - 1) * g.segment_stride + g.segment_bytes


def _addresses(plane: Plane, lo: int, hi: int) -> torch.Tensor:
    """Absolute addresses of every payload byte of the blocks that touch ``[lo, hi)``."""
    g = plane.geometry
    inner = _block_span(plane)
    stride = max(g.block_stride, 1)
    first = max(0, (lo - plane.offset - inner) // stride)
    last = min(g.num_blocks, (hi - plane.offset) // stride + 1)
    if last <= first:
        return torch.empty(0, dtype=torch.int64)
    blocks = torch.arange(first, last, dtype=torch.int64) * g.block_stride
    rows = torch.arange(g.rows_per_block, dtype=torch.int64) * g.row_stride
    segs = torch.arange(g.segments, dtype=torch.int64) * g.segment_stride
    byte = torch.arange(g.segment_bytes, dtype=torch.int64)
    addr = plane.offset + (blocks[:, None, None, None] + rows[:, None, None] + segs[:, None] + byte)
    return addr.reshape(-1)


def _window(*planes: Plane) -> int:
    blocks = max(p.geometry.block_stride + _block_span(p) for p in planes)
    return min(MAX_WINDOW, max(MIN_WINDOW, 2 * blocks))


def _strides_nest(plane: Plane) -> bool:
    g = plane.geometry
    dims = sorted(
        [(g.segment_bytes, 1), (g.segments, g.segment_stride), (g.rows_per_block, g.row_stride),
         (g.num_blocks, g.block_stride)],
        key=lambda d: d[1],
    )
    extent = 0
    for size, stride in dims:
        if size == 1:
            continue
        if stride <= extent:
            return False
        extent += (size - 1) * stride
    return True


def _start_end(plane: Plane) -> tuple[int, int]:
    return plane.offset, plane.offset + plane.geometry.span_bytes


def same_allocation(a: Plane, b: Plane) -> bool:
    """Whether two planes are carved from one real allocation (never for planned or meta planes)."""
    if a.storage is None or b.storage is None or a.storage.device.type == "meta":
        return False
    return a.storage.device == b.storage.device and a.storage.data_ptr() == b.storage.data_ptr()


def check_plane(plane: Plane) -> None:
    """Raise LayoutError if two slots (or two bytes of one row) of ``plane`` share a byte."""
    if _strides_nest(plane):
        return
    start, end = _start_end(plane)
    addr = _addresses(plane, start, min(end, start + _window(plane)))
    if addr.numel() != torch.unique(addr).numel():
        raise LayoutError(f"layer {plane.layer!r} plane {plane.name!r}: rows overlap themselves "
                          f"({plane.geometry})")


def check_layer(planes: Sequence[Plane]) -> None:
    """Raise LayoutError naming the pair if two planes of one layer share a byte of one allocation."""
    for plane in planes:
        check_plane(plane)
    for i, a in enumerate(planes):
        for b in planes[i + 1 :]:
            if not same_allocation(a, b):
                continue
            (a0, a1), (b0, b1) = _start_end(a), _start_end(b)
            lo, hi = max(a0, b0), min(a1, b1)
            if lo >= hi:
                continue
            hi = min(hi, lo + _window(a, b))
            if bool(torch.isin(_addresses(a, lo, hi), _addresses(b, lo, hi)).any()):
                raise LayoutError(
                    f"layer {a.layer!r}: planes {a.name!r} and {b.name!r} overlap in memory"
                )
