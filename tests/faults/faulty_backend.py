"""A deliberately WRONG kernel backend, so tests can show that our correctness oracles catch a bad transfer.

TEST FAULT ONLY. It runs the torch reference transfer and then damages the data in one way, chosen by
``LMCACHE_PLATFORMS_FAULT`` (read at every transfer, so one process can be switched between calls):

``none``   exactly the torch backend (the positive control)
``flip``   load: XOR 0x01 into byte 0 of the first loaded row (first real slot) of the launch's first plane
``shift``  load: every row lands one slot off, at ``slot + 1`` (``slot - 1`` for a plane's very last slot)
``zero``   load: in every plane, the rows of the first block the launch loads into are zeroed, not loaded
``swap``   store: the launch's first plane gets its first two real rows swapped in the chunk buffer
``raise``  load: the first load launch of the process raises TransferError before writing anything (a one-off
           kernel error on one chunk); every later transfer is the torch backend's

Unset or any other value makes the backend unavailable (selecting it then fails, naming the variable),
so a forgotten variable never passes as a clean run. It declares no ``device_types``: ``auto`` never
picks it, only an explicit ``--backend faulty`` / ``LMCACHE_PLATFORMS_KERNEL_BACKEND=faulty``.

``tests/faults/install.py`` copies this file as a standalone module next to a ``*.dist-info`` whose entry
point registers it, so it must import nothing from ``tests``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from lmcache_platforms.kernels.contract import Direction, TransferError
from lmcache_platforms.kernels.torch_backend import TorchBackend, byte_view
from lmcache_platforms.layout.plane import Plane

FAULT_ENV = "LMCACHE_PLATFORMS_FAULT"
FAULTS: dict[str, str] = {
    "none": "no fault (torch)",
    "flip": "load: one bit of byte 0 of the first loaded row flipped",
    "shift": "load: rows land at slot + 1",
    "zero": "load: the first block's rows zeroed",
    "swap": "store: the first two rows of the chunk buffer swapped",
    "raise": "load: the first load launch raises",
}


def current_fault() -> str | None:
    """The fault asked for now, or None when the variable is unset or names no fault."""
    fault = os.environ.get(FAULT_ENV, "").strip()
    return fault if fault in FAULTS else None


def _plane_slots(planes: Sequence[Plane], slots: torch.Tensor) -> torch.Tensor:
    """``[P, R]`` slots, whichever form the caller gave."""
    return slots if slots.dim() == 2 else slots.unsqueeze(0).expand(len(planes), slots.shape[-1])


class FaultyBackend(TorchBackend):
    """The torch transfer followed by the damage ``LMCACHE_PLATFORMS_FAULT`` names."""

    name = "faulty"
    raised = False  # the ``raise`` fault fires once per process

    def availability(self) -> tuple[bool, str]:
        fault = current_fault()
        if fault is None:
            return False, f"test fault backend: set {FAULT_ENV} to one of {', '.join(FAULTS)}"
        return True, f"TEST FAULT {fault}: {FAULTS[fault]}"

    def transfer(
        self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, direction: Direction
    ) -> None:
        fault = current_fault()
        if fault is None:
            raise ValueError(f"{FAULT_ENV}={os.environ.get(FAULT_ENV)!r} names no fault; one of {', '.join(FAULTS)}")
        if fault == "raise" and direction is Direction.LOAD and not FaultyBackend.raised:
            FaultyBackend.raised = True
            raise TransferError("TEST FAULT raise: a kernel error on this chunk's load")
        if fault == "shift" and direction is Direction.LOAD:
            super().transfer(planes, self._shifted(planes, slots), buffer, direction)
            return
        super().transfer(planes, slots, buffer, direction)
        if fault == "flip" and direction is Direction.LOAD:
            self._flip(planes[0], _plane_slots(planes, slots)[0])
        elif fault == "zero" and direction is Direction.LOAD:
            self._zero_first_block(planes, _plane_slots(planes, slots))
        elif fault == "swap" and direction is Direction.STORE:
            self._swap_first_rows(planes[0], _plane_slots(planes, slots)[0], buffer)

    @staticmethod
    def _shifted(planes: Sequence[Plane], slots: torch.Tensor) -> torch.Tensor:
        out = _plane_slots(planes, slots).clone()
        for index, plane in enumerate(planes):
            row = out[index]
            moved = torch.where(row + 1 < plane.geometry.num_slots, row + 1, row - 1)
            out[index] = torch.where(row >= 0, moved, row)
        return out

    @staticmethod
    def _flip(plane: Plane, slots: torch.Tensor) -> None:
        real = slots[slots >= 0]
        if real.numel():
            block, row = divmod(int(real[0]), plane.geometry.rows_per_block)
            plane.rows_view()[block, row, 0, 0] ^= 0x01

    @staticmethod
    def _zero_first_block(planes: Sequence[Plane], slots: torch.Tensor) -> None:
        for plane, plane_slots in zip(planes, slots, strict=True):
            real = plane_slots[plane_slots >= 0]
            if real.numel():
                per_block = plane.geometry.rows_per_block
                block = int(real[0]) // per_block
                rows = real[real // per_block == block] - block * per_block
                plane.rows_view()[block, rows.to(plane.storage.device)] = 0

    @staticmethod
    def _swap_first_rows(plane: Plane, slots: torch.Tensor, buffer: torch.Tensor) -> None:
        # The first plane's region opens the plane-major buffer: R rows of row_bytes.
        region = byte_view(buffer)[: slots.shape[-1] * plane.row_bytes].view(slots.shape[-1], plane.row_bytes)
        real = torch.nonzero(slots >= 0).flatten().tolist()[:2]
        if len(real) == 2:
            first, second = real
            region[[first, second]] = region[[second, first]].clone()
