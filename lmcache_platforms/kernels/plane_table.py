"""Per-plane parameter tables for the native and Triton kernels, built once per plane tuple and cached.

A table is an int64 ``[P, len(FIELDS)]`` tensor; each row is one plane's absolute base address, its byte
geometry and the row bytes of the planes before it (its rows start at ``buffer_prefix * R`` in the chunk
buffer). ``FIELDS`` and ``ABI_VERSION`` are the one definition of that row: the C and Ascend C kernels include
``csrc/lmcp_plane_table.h``, written from them by ``scripts/gen_plane_table_header.py`` (a test checks it is
current), and the Triton kernel gets each field's offset from ``FIELD``.
Building it is also where a plane is checked against the allocation behind it, because a native kernel
would otherwise write past it.
"""

from __future__ import annotations

import importlib.util
import math
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_platforms.kernels.contract import TransferError, validate_chunks, validate_transfer
from lmcache_platforms.layout.plane import Plane, buffer_bytes

# One int64 per field, in this order; the notes become the C struct's comments.
_FIELD_NOTES = {
    "base": "address of block 0, row 0, segment 0",
    "block_stride": "bytes",
    "rows_per_block": "",
    "row_stride": "bytes",
    "segments": "",
    "segment_bytes": "",
    "segment_stride": "bytes",
    "row_bytes": "segments * segment_bytes",
    "buffer_prefix": "row bytes of the planes before this one: its rows start at prefix * rows",
}
FIELDS = tuple(_FIELD_NOTES)
FIELD = {name: offset for offset, name in enumerate(FIELDS)}
# Reported by every native library built from csrc; bump whenever FIELDS or a native entry point's arguments
# change, so a stale build is refused.
ABI_VERSION = 2
HEADER_PATH = "csrc/lmcp_plane_table.h"


def built_library(module: str, hint: str) -> tuple[str | None, str]:
    """(the file of the native kernel library ``module``, "") or (None, why it is absent); both native
    backends (C for CPU, Ascend C) load one built against this table's ``ABI_VERSION``."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return None, f"cannot look up {module}: {exc}"
    if spec is None or not spec.origin:
        return None, f"{module} was not built; {hint}"
    return spec.origin, ""


def c_header() -> str:
    """``csrc/lmcp_plane_table.h``: the table row as a C struct, field offsets, field count and ABI version."""
    lines = [
        "/* Generated from lmcache_platforms/kernels/plane_table.py by scripts/gen_plane_table_header.py;",
        " * do not edit (tests/kernels/test_plane_table_schema.py checks it is current). */",
        "#ifndef LMCP_PLANE_TABLE_H",
        "#define LMCP_PLANE_TABLE_H",
        "",
        "#include <stdint.h>",
        "",
        f"#define LMCP_ABI_VERSION {ABI_VERSION}",
        f"#define LMCP_PLANE_FIELDS {len(FIELDS)}",
        "",
        "/* Offset of each field in one int64 table row. */",
        *(f"#define LMCP_F_{name.upper()} {offset}" for name, offset in FIELD.items()),
        "",
        "typedef struct {",
        *(f"    int64_t {name};" + (f" /* {note} */" if note else "") for name, note in _FIELD_NOTES.items()),
        "} lmcp_plane;",
        "",
        "#endif",
    ]
    return "\n".join(lines) + "\n"


def plane_device(planes: Sequence[Plane]) -> torch.device:
    """The one device every plane of a transfer group lives on."""
    devices = {p.storage.device for p in planes if p.storage is not None}
    if len(devices) != 1:
        raise TransferError(f"the planes of one transfer must share one device, got {sorted(map(str, devices))}")
    return devices.pop()


def check_bounds(plane: Plane) -> None:
    """Raise TransferError unless every payload byte of the plane lies inside its allocation."""
    if plane.storage is None:
        raise TransferError(f"plane {plane.name!r} of layer {plane.layer!r} has no tensor behind it")
    g = plane.geometry
    values = (g.block_stride, g.row_stride, g.segment_stride, g.num_blocks, plane.offset)
    if g.rows_per_block < 1 or g.segments < 1 or g.segment_bytes < 1 or min(values) < 0:
        raise TransferError(f"plane {plane.name!r} of layer {plane.layer!r} has an invalid geometry {g}")
    size = plane.storage.untyped_storage().nbytes()
    if plane.offset + g.span_bytes > size:
        raise TransferError(
            f"plane {plane.name!r} of layer {plane.layer!r} reaches byte {plane.offset + g.span_bytes} "
            f"of an allocation of {size} bytes"
        )


def build_table(planes: Sequence[Plane]) -> torch.Tensor:
    """The int64 ``[P, len(FIELDS)]`` CPU table of ``planes``, after checking each plane's bounds."""
    rows = []
    buffer_prefix = 0
    for plane in planes:
        check_bounds(plane)
        g = plane.geometry
        base = plane.allocation_address() + plane.offset
        own = {"base": base, "buffer_prefix": buffer_prefix}  # the rest are geometry attributes of the same name
        rows.append(tuple(own[name] if name in own else getattr(g, name) for name in FIELDS))
        buffer_prefix += g.row_bytes
    return torch.tensor(rows, dtype=torch.int64)


def address_unit(planes: Sequence[Plane]) -> int:
    """Widest of 8/4/2/1 bytes dividing every plane's base address, strides and segment size: the widest
    access a kernel may use on these planes (the chunk buffer's address must divide by it too)."""
    unit = 8
    for plane in planes:
        g = plane.geometry
        base = plane.allocation_address() + plane.offset
        for value in (base, g.block_stride, g.row_stride, g.segment_bytes, g.segment_stride):
            unit = math.gcd(unit, value)
    return unit


@dataclass(frozen=True)
class PlaneTable:
    """A plane tuple's kernel table plus what a quick validation of a call against it needs."""

    table: torch.Tensor
    device: torch.device  # where the planes live
    row_bytes: int  # chunk-buffer bytes per row, all planes together
    capacities: torch.Tensor  # int64 [P]: slots of each plane
    min_capacity: int
    address_unit: int  # ``address_unit(planes)``
    widest_row: int  # bytes of the widest plane row

    def validate(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor) -> None:
        """``validate_transfer`` for these planes, with the common (valid) case checked in a few tensor ops.

        Anything unusual is handed to ``validate_transfer`` itself, so errors read the same everywhere.
        """
        if not self._plainly_valid(slots, buffer):
            validate_transfer(planes, slots, buffer)

    def validate_chunks(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                        chunk_stride: int) -> None:
        """``validate_chunks`` for these planes, the common case checked the same quick way as ``validate``."""
        if not self._plainly_valid_chunks(slots, buffer, chunk_stride):
            validate_chunks(planes, slots, buffer, chunk_stride)

    def _plainly_valid_chunks(self, slots: torch.Tensor, buffer: torch.Tensor, chunk_stride: int) -> bool:
        if slots.dtype != torch.int64 or buffer.dtype != torch.uint8 or buffer.dim() != 1:
            return False
        if not buffer.is_contiguous() or slots.dim() not in (2, 3):
            return False
        if slots.dim() == 3 and slots.shape[1] != self.capacities.numel():
            return False
        count, rows = slots.shape[0], slots.shape[-1]
        per_chunk = rows * self.row_bytes
        if chunk_stride < per_chunk or buffer.numel() < ((count - 1) * chunk_stride + per_chunk if count else 0):
            return False
        if count == 0 or rows == 0:
            return True
        if slots.dim() == 2:
            return int(slots.max()) < self.min_capacity
        return bool((slots.amax(dim=(0, 2)).cpu() < self.capacities).all())

    def _plainly_valid(self, slots: torch.Tensor, buffer: torch.Tensor) -> bool:
        if slots.dtype != torch.int64 or not buffer.is_contiguous():
            return False
        if slots.dim() == 2:
            if slots.shape[0] != self.capacities.numel():
                return False
        elif slots.dim() != 1:
            return False
        rows = slots.shape[-1]
        if buffer.numel() * buffer.element_size() != rows * self.row_bytes:
            return False
        if rows == 0:
            return True
        if slots.dim() == 1:
            return int(slots.max()) < self.min_capacity
        return bool((slots.max(dim=1).values.cpu() < self.capacities).all())


# ``TableCache.entry``'s device for a table on the planes' own device: a backend's hot path then needs no pass
# over the planes to find it (60 planes cost tens of microseconds per launch, more than the launch itself).
ON_PLANES = "planes"


class TableCache:
    """An LRU of tables keyed by the planes and the address of each plane's allocation.

    The address is part of the key because planes compare equal by description alone: a new allocation
    with the same description must not reuse an old address. A transfer group passes the same plane tuple
    on every call, so that exact tuple is looked up by identity first (hashing 60 planes per call cost more
    than moving a small chunk). Entries hold their planes, hence their allocations, until evicted.
    Tables are never written after they are built; still, each backend keeps one cache per direction so
    store and load share nothing.
    """

    def __init__(self, capacity: int = 64) -> None:
        self._capacity = capacity
        self._tables: OrderedDict[tuple, PlaneTable] = OrderedDict()
        self._recent: OrderedDict[tuple[int, str], tuple[Sequence[Plane], PlaneTable]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, planes: Sequence[Plane], device: torch.device | None = None) -> torch.Tensor:
        """The int64 ``[P, len(FIELDS)]`` table tensor of ``planes`` on ``device`` (CPU when None)."""
        return self.entry(planes, device).table

    def entry(self, planes: Sequence[Plane], device: torch.device | str | None = None) -> PlaneTable:
        """The table of ``planes`` (tensor on ``device``, on the planes' own device for ``ON_PLANES``, CPU when
        None) with its quick validation."""
        fast_key = (id(planes), str(device))
        with self._lock:
            # Only tuples are remembered by identity, and each is held with its entry: while it is, no other
            # object has its id, and its planes cannot change.
            hit = self._recent.get(fast_key)
            if hit is not None:
                return hit[1]
        key = (tuple(planes), tuple(p.allocation_address() for p in planes), str(device))
        with self._lock:
            table = self._tables.get(key)
            if table is not None:
                self._tables.move_to_end(key)
        if table is None:
            tensor = build_table(planes)
            capacities = torch.tensor([p.geometry.num_slots for p in planes], dtype=torch.int64)
            own_device = plane_device(planes)
            target = own_device if device == ON_PLANES else device
            table = PlaneTable(
                table=tensor if target is None else tensor.to(target),
                device=own_device,
                row_bytes=buffer_bytes(planes, 1),
                capacities=capacities,
                min_capacity=int(capacities.min()),
                address_unit=address_unit(planes),
                widest_row=max(p.row_bytes for p in planes),
            )
        with self._lock:
            self._remember(self._tables, key, table)
            if isinstance(planes, tuple):
                self._remember(self._recent, fast_key, (planes, table))
        return table

    def _remember(self, cache: OrderedDict, key, value) -> None:
        cache[key] = value
        cache.move_to_end(key)
        while len(cache) > self._capacity:
            cache.popitem(last=False)
