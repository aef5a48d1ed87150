"""The overlap check's byte window (``layout.overlap``): it enumerates every payload byte of a plane that lies in
the asked range and no byte outside the plane, so a clash in that range is never missed and never invented."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_platforms.layout.overlap import _addresses, _block_span
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.strategies import geometries, interleaved_geometries
from tests.layout.addresses import payload_addresses


@given(st.one_of(geometries(), interleaved_geometries()), st.integers(0, 300), st.data())
def test_the_window_holds_every_payload_byte_in_range_and_none_outside_the_plane(g: PlaneGeometry, offset: int,
                                                                                 data: st.DataObject) -> None:
    every = payload_addresses(g, range(g.num_slots), offset)
    end = offset + g.span_bytes
    lo = data.draw(st.integers(offset, end + 2 * g.block_stride))
    hi = data.draw(st.integers(lo, end + 3 * g.block_stride))
    got = _addresses(Plane("l", "p", 0, torch.uint8, g, offset), lo, hi)
    assert got.dtype == torch.int64
    assert {a for a in every if lo <= a < hi} <= set(got.tolist()) <= set(every)
    if lo >= end + g.block_stride:  # a whole block past the plane's end: nothing left to enumerate
        assert got.numel() == 0


@given(st.one_of(geometries(), interleaved_geometries()))
def test_a_blocks_span_ends_at_its_last_payload_byte(g: PlaneGeometry) -> None:
    block = payload_addresses(g, range(g.rows_per_block))
    assert _block_span(Plane("l", "p", 0, torch.uint8, g)) == max(block) + 1


def test_one_byte_blocks_are_each_enumerated() -> None:
    """The smallest block stride (one byte a block, one row of one byte): every block of the range is there."""
    plane = Plane("l", "p", 0, torch.uint8, PlaneGeometry(8, 1, 1, 1, 1, 1, 1), 3)
    assert set(range(3, 11)) <= set(_addresses(plane, 3, 11).tolist()) <= set(range(3, 11))
