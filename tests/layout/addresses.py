"""The address oracle of the layout tests: every payload byte of a plane, element by element, from the geometry's
per-byte formula only (``PlaneGeometry.byte_address``), against which the layout's range and stride math is
checked."""

from __future__ import annotations

from collections.abc import Iterable

from lmcache_platforms.layout.plane import PlaneGeometry


def payload_addresses(g: PlaneGeometry, slots: Iterable[int], base: int = 0) -> list[int]:
    """``base`` plus the address of every payload byte of ``slots``, slot by slot, segment by segment."""
    return [base + g.byte_address(slot, s, b)
            for slot in slots for s in range(g.segments) for b in range(g.segment_bytes)]
