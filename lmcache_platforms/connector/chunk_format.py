"""Where each kernel launch's bytes live inside one LMCache MemoryObj.

A chunk's MemoryObj is ONE tensor (not one per transfer group): LMCache 0.5.6's local disk backend keeps
only the first shape/dtype of a multi-tensor object (``.tensor`` even raises for one), so a multi-tensor
chunk could not be written to disk. Every launch owns a byte range of that tensor instead; all groups of a
chunk (or of one chunk part, ``connector.parts``) live and die together under one key.

After the launches' bytes (the payload) comes the checksum trailer (``connector.checksum``), then padding to
a multiple of ``chunk_size`` elements, because LMCache's remote connectors assert that a full chunk divides
into whole "tokens"; the padding is never read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from lmcache_platforms.connector.checksum import format_version, tail_bytes
from lmcache_platforms.layout.kv_layout import KVLayout, TransferGroup
from lmcache_platforms.layout.plane import Plane, buffer_bytes

LAYOUT_TAG = "lmcache.tag.lmcp_layout"


@dataclass(frozen=True)
class Launch:
    """One kernel call: ``planes`` (all or part of transfer group ``tg``) <-> ``[offset, offset + nbytes)``."""

    tg: TransferGroup
    planes: tuple[Plane, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class ChunkFormat:
    """The MemoryObj of one chunk (or one layerwise step of a chunk): its shape, dtype and launches."""

    launches: tuple[Launch, ...]
    shape: torch.Size
    dtype: torch.dtype
    fingerprint: str

    @property
    def nbytes(self) -> int:
        """Bytes of the MemoryObj, padding included."""
        return self.shape.numel() * self.dtype.itemsize

    @property
    def payload_bytes(self) -> int:
        """Bytes the launches fill (the checksum trailer follows them, then padding)."""
        return sum(launch.nbytes for launch in self.launches)


def _launches(units: Sequence[tuple[TransferGroup, tuple[Plane, ...]]]) -> tuple[Launch, ...]:
    out, offset = [], 0
    for tg, planes in units:
        nbytes = buffer_bytes(planes, tg.rows_per_chunk)
        out.append(Launch(tg, planes, offset, nbytes))
        offset += nbytes
    return tuple(out)


def _fingerprint(chunk_size: int, launches: Sequence[Launch]) -> str:
    """Changes whenever the byte order of a chunk would, so differently laid-out chunks never share a key."""
    digest = hashlib.sha256(f"{chunk_size}|{format_version()}".encode())
    for launch in launches:
        digest.update(f"|{launch.tg.group}:{launch.tg.rows_per_chunk}:{launch.offset}".encode())
        for p in launch.planes:
            g = p.geometry
            digest.update(f";{p.layer}/{p.name}:{g.segments}x{g.segment_bytes}:{p.dtype}".encode())
    return digest.hexdigest()[:16]


def _padded_elements(nbytes: int, chunk_size: int, dtype: torch.dtype) -> int:
    unit = chunk_size * dtype.itemsize
    return -(-max(nbytes, 1) // unit) * chunk_size


def paged_format(layout: KVLayout, transfer_groups: Sequence[int] | None = None) -> ChunkFormat:
    """Every transfer group of the layout (or those of one chunk part) in one uint8 ``[1, 1, chunk_size, n]``
    tensor.

    The shape reads as LMCache's KV_2LTD (token dimension 2) so its helpers count ``chunk_size`` tokens.
    """
    chosen = layout.transfer_groups if transfer_groups is None else [layout.transfer_groups[i]
                                                                     for i in transfer_groups]
    launches = _launches([(tg, tg.planes) for tg in chosen])
    total = sum(launch.nbytes for launch in launches)
    elements = _padded_elements(total + tail_bytes(total), layout.chunk_size, torch.uint8)
    shape = torch.Size([1, 1, layout.chunk_size, elements // layout.chunk_size])
    return ChunkFormat(launches, shape, torch.uint8, _fingerprint(layout.chunk_size, launches))


def layer_launches(fmt: ChunkFormat, layer_order: Sequence[str]) -> tuple[tuple[str, tuple[Launch, ...]], ...]:
    """``fmt``'s launches cut by layer, in ``layer_order``: for each layer, one launch per transfer group holding
    that layer's planes, over the same bytes of the MemoryObj (a launch's region is plane-major, so a layer's run
    of planes owns a contiguous piece of it). Moving every layer's launches moves exactly ``fmt``'s bytes: the
    layerwise mode fills and reads the same chunk objects as the paged mode."""
    rank = {name: i for i, name in enumerate(layer_order)}
    per_layer: dict[str, list[Launch]] = {}
    for launch in fmt.launches:
        offset, run = launch.offset, [launch.planes[0]]
        for plane in (*launch.planes[1:], None):
            if plane is not None and plane.layer == run[0].layer:
                run.append(plane)
                continue
            nbytes = buffer_bytes(run, launch.tg.rows_per_chunk)
            per_layer.setdefault(run[0].layer, []).append(Launch(launch.tg, tuple(run), offset, nbytes))
            offset += nbytes
            if plane is not None:
                run = [plane]
    unknown = sorted(set(per_layer) - set(rank))
    if unknown:
        raise ValueError(f"layers {unknown} of the chunk format are not in the layer order")
    return tuple((name, tuple(per_layer[name])) for name in sorted(per_layer, key=rank.__getitem__))


def split_layers(names: Sequence[str], steps: int) -> list[tuple[str, ...]]:
    """``names`` in order, cut into ``steps`` contiguous non-empty runs of near-equal length."""
    if not 0 < steps <= len(names):
        raise ValueError(f"cannot split {len(names)} layers into {steps} layerwise steps")
    base, extra = divmod(len(names), steps)
    out, start = [], 0
    for step in range(steps):
        stop = start + base + (step < extra)
        out.append(tuple(names[start:stop]))
        start = stop
    return out


def step_formats(layout: KVLayout, steps: int, dtype: torch.dtype) -> list[ChunkFormat]:
    """One format per layerwise step; all share one shape ``[chunk_size, 1, n]`` of ``dtype``.

    LMCache allocates every layer's object with the same shape and the model dtype, so each step is padded
    to the largest (with its trailer). A step covers a contiguous run of the layout's layers (all their planes).
    """
    parts = split_layers([entry.name for entry in layout.layers], steps)
    owner = {p: i for i, names in enumerate(parts) for entry in layout.layers if entry.name in names
             for p in entry.planes}
    per_step = []
    for step in range(steps):
        units = []
        for tg in layout.transfer_groups:
            planes = tuple(p for p in tg.planes if owner.get(p) == step)
            if planes:
                units.append((tg, planes))
        per_step.append(_launches(units))
    widest = max(sum(launch.nbytes for launch in launches) for launches in per_step)
    elements = _padded_elements(widest + tail_bytes(widest), layout.chunk_size, dtype)
    shape = torch.Size([layout.chunk_size, 1, elements // layout.chunk_size])
    return [ChunkFormat(launches, shape, dtype, _fingerprint(layout.chunk_size, launches))
            for launches in per_step]


def layout_fingerprint(formats: Sequence[ChunkFormat]) -> str:
    """One short id for a list of formats (the layerwise steps, or the single paged format)."""
    digest = hashlib.sha256("".join(f.fingerprint for f in formats).encode())
    return digest.hexdigest()[:16]
