"""Ascend C transfer on NPUs: one launch of ``csrc/ascend``'s kernel per transfer group and direction.

The kernel is a torch op (``torch.ops.lmcache_platforms_ascend.transfer``) in the library
``lmcache_platforms.kernels._ascend_transfer``, built by ``csrc/ascend/build.py`` only where CANN is found.
It reads the same int64 plane table as the CPU and Triton kernels (absolute addresses, byte geometry), so any
segmented row works: NHD, HND and 310P FRACTAL_NZ planes alike. Planes, slots and buffer are NPU memory; the
310P build copies in 32-byte units, so it declines geometries that are not 32-byte multiples (``unsupported``)
and the registry falls back to ``torch``. torch_npu and the library load on first use, never at import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Sequence
from typing import Any

import torch

from lmcache_platforms.kernels.contract import Direction, KernelBackend, TransferError, validate_transfer
from lmcache_platforms.kernels.plane_table import ABI_VERSION, TableCache, built_library, plane_device
from lmcache_platforms.layout.plane import Plane

LIBRARY_MODULE = "lmcache_platforms.kernels._ascend_transfer"
OP_NAMESPACE = "lmcache_platforms_ascend"
_BUILD_HINT = ("build it where CANN is installed: `source <CANN>/set_env.sh; SOC_VERSION=<chip> "
               "pip install -e .` (or `python csrc/ascend/build.py`)")


@functools.cache
def load_op() -> tuple[Any, str]:
    """(the op namespace, "") or (None, why the Ascend kernel cannot be used here)."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch_npu is not installed"
    path, why = built_library(LIBRARY_MODULE, _BUILD_HINT)
    if path is None:
        return None, why
    try:
        importlib.import_module("torch_npu")
        torch.ops.load_library(path)
        ops = getattr(torch.ops, OP_NAMESPACE)
        version = ops.abi_version()
    except Exception as exc:  # noqa: BLE001 - a stale or broken build must read as "unavailable", with why
        return None, f"cannot load {path}: {type(exc).__name__}: {exc}; {_BUILD_HINT}"
    if version != ABI_VERSION:
        return None, f"{path} has ABI {version}, this package needs {ABI_VERSION}; {_BUILD_HINT}"
    return ops, ""


def misaligned(planes: Sequence[Plane], alignment: int) -> str | None:
    """The first plane whose addresses or sizes are not multiples of ``alignment`` bytes, described."""
    prefix = 0
    for plane in planes:
        g = plane.geometry
        base = plane.storage.untyped_storage().data_ptr() + plane.offset if plane.storage is not None else 0
        values = {"base address": base, "block_stride": g.block_stride, "row_stride": g.row_stride,
                  "segment_bytes": g.segment_bytes, "segment_stride": g.segment_stride, "buffer offset": prefix}
        for what, value in values.items():
            if value % alignment:
                return (f"plane {plane.name!r} of layer {plane.layer!r}: {what} {value} is not a multiple of "
                        f"{alignment} bytes, which this chip's Ascend kernel needs")
        prefix += g.row_bytes
    return None


class AscendBackend(KernelBackend):
    """Planes, slots and chunk buffer on one Ascend NPU; store and load keep separate tables."""

    name = "ascend"

    def __init__(self) -> None:
        self._tables = {direction: TableCache() for direction in Direction}

    def availability(self) -> tuple[bool, str]:
        ops, reason = load_op()
        if ops is None:
            return False, reason
        if not torch.npu.is_available():  # type: ignore[attr-defined]
            return False, "the Ascend kernel is built but no NPU is visible"
        return True, f"Ascend C kernel ({ops.alignment()}-byte granularity)"

    def unsupported(self, planes: Sequence[Plane]) -> str | None:
        devices = {p.storage.device.type for p in planes if p.storage is not None}
        if devices - {"npu"}:
            return f"planes on {sorted(devices)}, the ascend backend moves NPU memory only"
        for plane in planes:
            g = plane.geometry
            if g.segments > 1 and g.segment_stride < g.segment_bytes:
                return f"plane {plane.name!r} of layer {plane.layer!r} has overlapping segments ({g})"
        ops, reason = load_op()
        if ops is None:
            return reason
        alignment = ops.alignment()
        return misaligned(planes, alignment) if alignment > 1 else None

    def transfer(
        self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, direction: Direction
    ) -> None:
        validate_transfer(planes, slots, buffer)
        reason = self.unsupported(planes)
        if reason:
            raise TransferError(reason)
        ops, _ = load_op()
        device = plane_device(planes)
        if buffer.device != device:
            raise TransferError(f"the ascend backend needs the buffer on {device}, got {buffer.device}")
        alignment = ops.alignment()
        if buffer.data_ptr() % alignment:
            raise TransferError(f"chunk buffer address {buffer.data_ptr()} is not {alignment}-byte aligned")
        rows = slots.shape[-1]
        if rows == 0:
            return
        table = self._tables[direction].get(planes, device)
        slots = slots.to(device, non_blocking=True).contiguous()
        ops.transfer(table, slots, buffer.reshape(-1).view(torch.uint8), rows if slots.dim() == 2 else 0,
                     direction is Direction.STORE)


BACKEND = AscendBackend()
