"""Native CPU transfer: one call into ``csrc/cpu/kv_transfer.c`` per transfer group and direction.

The library is a plain C ABI loaded with ctypes (no Python headers, no torch ABI to match), built by setup.py
as ``lmcache_platforms.kernels._cpu_transfer``; it runs on the calling thread plus its own helper threads,
as many in all as torch's intra-op thread count. When the build failed the backend reports itself unavailable
with the reason, and the registry falls back to ``torch``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from lmcache_platforms.kernels.contract import Direction, KernelBackend, TransferError, validate_transfer
from lmcache_platforms.kernels.native_library import load_library
from lmcache_platforms.kernels.plane_table import TableCache
from lmcache_platforms.kernels.stripe_hashing import StripeCheck, StripeSink
from lmcache_platforms.layout.plane import Plane
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

_DIRECTIONS = {Direction.STORE: 0, Direction.LOAD: 1}


class _Call(NamedTuple):
    """A validated call's leading arguments, and the host slots they point into (alive until it returns)."""

    args: tuple[int, int, int, int, int, int]
    slots: torch.Tensor


class CpuBackend(KernelBackend):
    """Planes, slots and buffer all in host memory; parallel over (plane, row) with torch's thread count."""

    name = "cpu"

    def __init__(self) -> None:
        self._tables = {direction: TableCache() for direction in Direction}
        self._warned = False

    def availability(self) -> tuple[bool, str]:
        lib, reason = load_library()
        return (True, f"native C library, {torch.get_num_threads()} threads") if lib else (False, reason)

    def unsupported(self, planes: Sequence[Plane]) -> str | None:
        devices = {p.storage.device.type for p in planes if p.storage is not None}
        if devices - {"cpu"}:
            return f"planes on {sorted(devices)}, the cpu backend moves host memory only"
        return None

    def transfer(
        self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, direction: Direction
    ) -> None:
        lib, call = self._checked(planes, slots, buffer, direction)
        if call is None:
            return
        status = lib.lmcp_transfer(*call.args, _DIRECTIONS[direction], torch.get_num_threads())
        if status != 0:
            raise TransferError(f"native transfer failed with status {status}")

    def store_hashed(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                     stripes: StripeSink, offset: int) -> None:
        """The store hashes each byte as it copies it (``lmcp_transfer_crc``), on the same threads."""
        self._hashed(planes, slots, buffer, stripes, offset, Direction.STORE)

    def load_hashed(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                    stripes: StripeSink, offset: int) -> None:
        """The load hashes each byte as it copies it (``lmcp_transfer_load_crc``), on the same threads."""
        self._hashed(planes, slots, buffer, stripes, offset, Direction.LOAD)

    def _hashed(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, stripes: StripeSink,
                offset: int, direction: Direction) -> None:
        lib, call = self._checked(planes, slots, buffer, direction)
        if call is None:
            stripes.feed(buffer, offset)
            return
        entry = lib.lmcp_transfer_crc if direction is Direction.STORE else lib.lmcp_transfer_load_crc
        status = entry(*call.args, torch.get_num_threads(), offset, stripes.stripe, stripes.payload_bytes,
                       stripes.registers_address, stripes.lengths_address)
        if status == -2:
            raise MemoryError(f"the native hashing {direction.value} could not allocate its list of hashed pieces")
        if status != 0:
            raise TransferError(f"native hashing {direction.value} failed with status {status}")

    def load_checked(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, check: StripeCheck,
                     offset: int) -> bool:
        """Each stripe is checked by the thread that first needs it, just before its rows are written, so the
        copy reads it from cache (``lmcp_transfer_checked``)."""
        lib, call = self._checked(planes, slots, buffer, Direction.LOAD)
        if call is None:
            return True
        status = lib.lmcp_transfer_checked(*call.args, torch.get_num_threads(), offset, check.address,
                                           check.payload_bytes, check.stripe, check.expected_address,
                                           check.state_address)
        if status < 0:
            raise TransferError(f"native checked load failed with status {status}")
        return status == 0

    def _checked(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                 direction: Direction) -> tuple[ctypes.CDLL, _Call | None]:
        """The library and the validated call's leading arguments (None: no rows, nothing to move)."""
        lib, reason = load_library()
        if lib is None:
            if not self._warned:
                self._warned = True
                logger.warning("native CPU transfer kernels unavailable: %s", reason)
            raise TransferError(f"the cpu backend is unavailable: {reason}")
        if not planes:
            validate_transfer(planes, slots, buffer)
        entry = self._tables[direction].entry(planes)
        if entry.device.type != "cpu" or buffer.device.type != "cpu":
            raise TransferError(
                f"the cpu backend needs host tensors, got planes on {entry.device} and the buffer on {buffer.device}"
            )
        entry.validate(planes, slots, buffer)
        rows = slots.shape[-1]
        if rows == 0:
            return lib, None
        slots = slots.contiguous() if slots.device.type == "cpu" else slots.to("cpu").contiguous()
        args = (entry.table.data_ptr(), len(planes), slots.data_ptr(), rows if slots.dim() == 2 else 0, rows,
                buffer.data_ptr())
        return lib, _Call(args, slots)


BACKEND = CpuBackend()
