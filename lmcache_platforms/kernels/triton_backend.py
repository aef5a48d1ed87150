"""Triton transfer for CUDA and XPU (Intel's Triton backend): one launch per transfer group and direction,
for one chunk (``transfer``) or a whole batch of chunks (``transfer_chunks``: launching from Python costs tens
of microseconds, more than the GPU needs to move a small chunk).

The grid is (row of the batch, plane, piece of row); each program reads its plane's geometry from an int64
table on the device (absolute addresses, so planes may live in different allocations) and moves one piece of
one row in the widest unit (1, 2, 4 or 8 bytes) that every address and size of the group is a multiple of.
On CPU it runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter), which is how CI tests it.
Triton is imported on first use, never at module import.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Sequence

import torch

from lmcache_platforms.kernels.contract import (
    Direction,
    KernelBackend,
    TransferError,
    validate_chunks,
    validate_transfer,
)
from lmcache_platforms.kernels.plane_table import FIELD, FIELDS, ON_PLANES, PlaneTable, TableCache, address_unit
from lmcache_platforms.layout.plane import Plane

GPU_DEVICES = ("cuda", "xpu")
_UNIT_DTYPES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}
UNITS = tuple(_UNIT_DTYPES)
# Plane-table fields the kernel reads, each passed as a constexpr offset (upper-cased name) from FIELD.
_TABLE_FIELDS_READ = ("base", "block_stride", "rows_per_block", "row_stride", "segment_bytes", "segment_stride",
                      "row_bytes", "buffer_prefix")


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _gpu_present() -> bool:
    if torch.cuda.is_available():
        return True
    xpu = getattr(torch, "xpu", None)
    return bool(xpu is not None and xpu.is_available())


@functools.cache
def _kernel():
    """Compile-on-demand kernel, defined here so that importing this module never imports Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def transfer_kernel(
        table_ptr,
        slots_ptr,
        slots_chunk_stride,
        slots_plane_stride,
        num_rows,
        buffer_ptr,
        buffer_chunk_stride,
        FIELD_COUNT: tl.constexpr,
        BASE: tl.constexpr,
        BLOCK_STRIDE: tl.constexpr,
        ROWS_PER_BLOCK: tl.constexpr,
        ROW_STRIDE: tl.constexpr,
        SEGMENT_BYTES: tl.constexpr,
        SEGMENT_STRIDE: tl.constexpr,
        ROW_BYTES: tl.constexpr,
        BUFFER_PREFIX: tl.constexpr,
        UNIT: tl.constexpr,
        UNIT_DTYPE: tl.constexpr,
        STORE: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        batch_row = tl.program_id(0).to(tl.int64)
        chunk = batch_row // num_rows
        row = batch_row - chunk * num_rows
        plane = tl.program_id(1).to(tl.int64)
        piece = tl.program_id(2).to(tl.int64)
        entry = table_ptr + plane * FIELD_COUNT
        base = tl.load(entry + BASE)
        block_stride = tl.load(entry + BLOCK_STRIDE)
        rows_per_block = tl.load(entry + ROWS_PER_BLOCK)
        row_stride = tl.load(entry + ROW_STRIDE)
        segment_bytes = tl.load(entry + SEGMENT_BYTES)
        segment_stride = tl.load(entry + SEGMENT_STRIDE)
        row_bytes = tl.load(entry + ROW_BYTES)
        buffer_prefix = tl.load(entry + BUFFER_PREFIX)
        slot = tl.load(slots_ptr + chunk * slots_chunk_stride + plane * slots_plane_stride + row)
        safe = tl.maximum(slot, 0)
        block = safe // rows_per_block
        in_block = safe - block * rows_per_block
        offs = (piece * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * UNIT
        mask = offs < tl.where(slot >= 0, row_bytes, 0)
        segment = offs // segment_bytes
        within = offs - segment * segment_bytes
        plane_addr = base + block * block_stride + in_block * row_stride + segment * segment_stride + within
        plane_ptrs = plane_addr.to(tl.pointer_type(UNIT_DTYPE))
        buffer_addr = buffer_ptr + chunk * buffer_chunk_stride + buffer_prefix * num_rows + row * row_bytes + offs
        buffer_ptrs = buffer_addr.to(tl.pointer_type(UNIT_DTYPE))
        if STORE:
            tl.store(buffer_ptrs, tl.load(plane_ptrs, mask=mask), mask=mask)
        else:
            tl.store(plane_ptrs, tl.load(buffer_ptrs, mask=mask), mask=mask)

    return transfer_kernel, tl


@functools.cache
def launch_constants(unit: int, direction: Direction, block: int) -> dict[str, object]:
    """The constexpr arguments of one launch, i.e. what the kernel is compiled for (shared with the
    ahead-of-time compile tests, so they compile exactly what a launch runs); made once per combination."""
    _, tl = _kernel()
    return {
        "FIELD_COUNT": len(FIELDS),
        **{name.upper(): FIELD[name] for name in _TABLE_FIELDS_READ},
        "UNIT": unit,
        "UNIT_DTYPE": getattr(tl, _UNIT_DTYPES[unit]),
        "STORE": direction is Direction.STORE,
        "BLOCK": block,
    }


def transfer_unit(planes: Sequence[Plane], buffer_address: int) -> int:
    """Widest of 8/4/2/1 bytes dividing every address, stride and size the kernel touches."""
    return math.gcd(address_unit(planes), buffer_address)


def _unsupported_devices(devices: set[str]) -> str | None:
    """Why planes on these device types cannot be moved here, or None."""
    allowed = {*GPU_DEVICES, "cpu"} if interpreting() else set(GPU_DEVICES)
    if devices - allowed:
        return f"planes on {sorted(devices)}, triton here moves {sorted(allowed)} memory"
    return None


class TritonBackend(KernelBackend):
    """Planes and buffer on the same CUDA/XPU device (or CPU under the interpreter)."""

    name = "triton"
    block = 1024

    def __init__(self) -> None:
        self._tables = {direction: TableCache() for direction in Direction}

    def availability(self) -> tuple[bool, str]:
        # Without a device to run on, Triton is not imported (a sixth of a second `doctor` need not spend).
        if not interpreting() and not _gpu_present():
            return False, "no CUDA or XPU device (set TRITON_INTERPRET=1 to run on CPU)"
        try:
            import triton
        except ImportError as exc:
            return False, f"triton is not installed ({exc})"
        if interpreting():
            return True, f"triton {triton.__version__} interpreter (TRITON_INTERPRET=1)"
        return True, f"triton {triton.__version__}"

    def unsupported(self, planes: Sequence[Plane]) -> str | None:
        return _unsupported_devices({p.storage.device.type for p in planes if p.storage is not None})

    def transfer(
        self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, direction: Direction
    ) -> None:
        if not planes:
            validate_transfer(planes, slots, buffer)
        entry = self._entry(planes, buffer, direction)
        entry.validate(planes, slots, buffer)
        self._launch(entry, planes, slots.unsqueeze(0), buffer.reshape(-1).view(torch.uint8), 0, direction)

    def transfer_chunks(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                        chunk_stride: int, direction: Direction) -> None:
        if not planes:
            validate_chunks(planes, slots, buffer, chunk_stride)
        entry = self._entry(planes, buffer, direction)
        entry.validate_chunks(planes, slots, buffer, chunk_stride)
        self._launch(entry, planes, slots, buffer, chunk_stride, direction)

    def _entry(self, planes: Sequence[Plane], buffer: torch.Tensor, direction: Direction) -> PlaneTable:
        entry = self._tables[direction].entry(planes, ON_PLANES)
        device = entry.device
        reason = _unsupported_devices({device.type})
        if reason:
            raise TransferError(reason)
        if buffer.device != device:
            raise TransferError(f"the triton backend needs the buffer on {device}, got {buffer.device}")
        return entry

    def _launch(self, entry: PlaneTable, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                chunk_stride: int, direction: Direction) -> None:
        """One launch over every row of every chunk: ``slots`` ``[N, R]`` or ``[N, P, R]``, checked."""
        chunks, rows = slots.shape[0], slots.shape[-1]
        if chunks == 0 or rows == 0:
            return
        kernel, _ = _kernel()
        # Slots on the host (as the connector passes them) were checked there and cross without a device sync.
        slots = slots.to(entry.device, non_blocking=True).contiguous()
        unit = math.gcd(entry.address_unit, buffer.data_ptr(), chunk_stride)
        widest = entry.widest_row // unit
        block = min(self.block, 1 << max(0, (widest - 1).bit_length()))
        grid = (chunks * rows, len(planes), -(-widest // block))
        kernel[grid](
            entry.table,
            slots,
            slots.stride(0),
            slots.stride(1) if slots.dim() == 3 else 0,
            rows,
            buffer,
            chunk_stride,
            **launch_constants(unit, direction, block),
        )


BACKEND = TritonBackend()
