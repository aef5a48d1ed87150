"""Reference transfer in plain torch indexing: works on any device, and is the oracle for every other backend.

It loops over planes on purpose (clarity over speed); the accelerated backends must match it bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_platforms.kernels.contract import Direction, KernelBackend, validate_transfer
from lmcache_platforms.kernels.plane_table import check_bounds
from lmcache_platforms.layout.plane import Plane


def byte_view(buffer: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor of any dtype, as a flat uint8 view."""
    return buffer.reshape(-1).view(torch.uint8)


class TorchBackend(KernelBackend):
    """Gather/scatter by slot over each plane's ``rows_view``; the buffer may live on another device."""

    name = "torch"

    def availability(self) -> tuple[bool, str]:
        return True, "pure torch, any device"

    def transfer(
        self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, direction: Direction
    ) -> None:
        validate_transfer(planes, slots, buffer)
        for plane in planes:
            check_bounds(plane)
        rows = slots.shape[-1]
        if rows == 0:
            return
        flat = byte_view(buffer)
        start = 0
        for index, plane in enumerate(planes):
            g = plane.geometry
            region = flat[start : start + rows * g.row_bytes].view(rows, g.segments, g.segment_bytes)
            start += rows * g.row_bytes
            view = plane.rows_view()
            plane_slots = (slots[index] if slots.dim() == 2 else slots).to(view.device)
            keep = plane_slots >= 0
            picked = plane_slots[keep]
            blocks = torch.div(picked, g.rows_per_block, rounding_mode="floor")
            offsets = picked - blocks * g.rows_per_block
            keep = keep.to(region.device)
            if direction is Direction.STORE:
                region[keep] = view[blocks, offsets].to(region.device)
            else:
                view[blocks, offsets] = region[keep].to(view.device)


BACKEND = TorchBackend()
