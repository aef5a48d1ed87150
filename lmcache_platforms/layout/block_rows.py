"""Block rows: a group whose chunks cover whole blocks moves each block's page of a plane as one row.

A chunk normally stores one row per token (or compressed row). Where a plane keeps a block's rows side by
side (HND pages, vLLM's CPU layout with K transposed inside the block), those rows are short, scattered
pieces in token order but one dense page per block; copying pages runs at memory speed, copying rows one
piece at a time does not. Re-describing the group with one row per block (``block_size`` 1 row of
``tokens_per_block`` tokens) and each plane with one row per block page changes only which bytes a row
holds, not which bytes a chunk holds, so every kernel, slot function and chunk format works unchanged.

It applies only where that is true: the chunk size is a multiple of the group's block tokens (a sliding
window then keeps the whole blocks its tokens lie in), the layout saves whole chunks only (a partial
chunk would end inside a block), and every plane's rows of one block tile whole pieces of its page.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.overlap import same_allocation
from lmcache_platforms.layout.plane import Plane, PlaneGeometry

ROW_UNITS = ("blocks", "tokens")


def block_row_geometry(g: PlaneGeometry) -> PlaneGeometry | None:
    """The geometry with one row per block, or None when a block's rows are not packed.

    Packed means the rows lie side by side inside each segment (``row_stride == segment_bytes``: HND pages,
    K transposed) or whole rows lie side by side (``row_stride == row_bytes``, dense rows: NHD pages). The
    block row is then the block's page as dense segments, merged into one where they touch.
    """
    rows = g.rows_per_block
    if g.row_stride == g.segment_bytes and (g.segments == 1 or g.segment_stride >= rows * g.segment_bytes):
        segments, segment_bytes, segment_stride = g.segments, rows * g.segment_bytes, g.segment_stride
    elif g.segment_stride == g.segment_bytes and g.row_stride == g.row_bytes:
        segments, segment_bytes, segment_stride = 1, rows * g.row_bytes, 0
    else:
        return None
    if segments == 1 or segment_stride == segment_bytes:
        segments, segment_bytes, segment_stride = 1, segments * segment_bytes, 0
    return PlaneGeometry(g.num_blocks, g.block_stride, 1, 0, segments, segment_bytes, segment_stride)


def block_row_group(group: KVGroup, chunk_size: int) -> KVGroup | None:
    """The group with one row per block, or None where its kind says a chunk would cut a block."""
    if not group.kind.block_rows_fit(group, chunk_size):
        return None
    per_block = group.tokens_per_block
    window = group.sliding_window
    if window is not None:  # chunks end on block boundaries: the window's tokens lie in its last ceil(SW/B) blocks
        window = -(-window // per_block) * per_block
    return dataclasses.replace(group, block_size=1, tokens_per_row=per_block, sliding_window=window)


def _pieces(plane: Plane) -> list[tuple[int, int]]:
    g = plane.geometry
    return [(plane.offset + s * g.segment_stride, plane.offset + s * g.segment_stride + g.segment_bytes)
            for s in range(g.segments)]


def merged_page(planes: Sequence[Plane]) -> Plane | None:
    """One plane for block-row ``planes`` of one layer whose pieces tile one stretch of every block without a
    gap (a layer's K and V heads side by side in its page): one copy per block instead of one per piece."""
    first = planes[0]
    g = first.geometry
    if len(planes) < 2 or any(p.geometry.block_stride != g.block_stride or p.geometry.num_blocks != g.num_blocks
                              or not same_allocation(first, p) for p in planes[1:]):
        return None
    pieces = sorted(piece for p in planes for piece in _pieces(p))
    lo, hi = pieces[0][0], pieces[0][0]
    for start, end in pieces:
        if start != hi:
            return None
        hi = end
    if g.block_stride <= 0 or hi - lo > g.block_stride:
        return None
    dtypes = {p.dtype for p in planes}
    return dataclasses.replace(
        first, name=f"{first.name}+{len(planes) - 1}", dtype=dtypes.pop() if len(dtypes) == 1 else torch.uint8,
        geometry=PlaneGeometry(g.num_blocks, g.block_stride, 1, 0, 1, hi - lo, 0), offset=lo)


def as_block_rows(group: KVGroup, planes: Sequence[Plane], chunk_size: int) -> tuple[KVGroup, list[Plane]] | None:
    """``group`` and its ``planes`` re-described with block rows, each layer's planes merged into one where
    they tile its page (``merged_page``); None where any plane cannot be."""
    converted = block_row_group(group, chunk_size)
    if converted is None:
        return None
    by_layer: dict[str, list[Plane]] = {}
    for plane in planes:
        geometry = block_row_geometry(plane.geometry)
        if geometry is None or plane.geometry.rows_per_block != group.block_size:
            return None
        by_layer.setdefault(plane.layer, []).append(dataclasses.replace(plane, geometry=geometry))
    out: list[Plane] = []
    for layer_planes in by_layer.values():
        page = merged_page(layer_planes)
        out += [page] if page is not None else layer_planes
    return converted, out
