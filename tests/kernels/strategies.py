"""Random transfer groups at the byte level (padding, gaps, multi-segment rows, shared or separate allocations)
and helpers to run two backends on identical copies of them."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from hypothesis import strategies as st

from lmcache_platforms.kernels.contract import buffer_bytes
from lmcache_platforms.layout.plane import Plane, PlaneGeometry


def storage_of(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the tensor's whole allocation (how planes hold memory)."""
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


@st.composite
def geometries(draw, max_blocks: int = 5) -> PlaneGeometry:
    """One plane geometry; dense (mergeable rows) about half of the time."""
    rows_per_block = draw(st.integers(1, 4))
    segments = draw(st.integers(1, 3))
    segment_bytes = draw(st.integers(1, 6))
    dense = draw(st.booleans())
    segment_stride = segment_bytes + (0 if dense else draw(st.integers(0, 3)))
    row_extent = (segments - 1) * segment_stride + segment_bytes
    row_stride = row_extent + (0 if dense else draw(st.integers(0, 3)))
    block_stride = (rows_per_block - 1) * row_stride + row_extent + (0 if dense else draw(st.integers(0, 5)))
    return PlaneGeometry(
        num_blocks=draw(st.integers(1, max_blocks)),
        block_stride=block_stride,
        rows_per_block=rows_per_block,
        row_stride=row_stride,
        segments=segments,
        segment_bytes=segment_bytes,
        segment_stride=segment_stride,
    )


@st.composite
def interleaved_geometries(draw, max_blocks: int = 4) -> PlaneGeometry:
    """K stored transposed (vLLM's CPU ``vec`` cache): one element per segment, a block's rows side by side
    inside each segment; enough segments and rows for whole 8 x 8 tiles and leftovers of both."""
    rows_per_block = draw(st.integers(1, 24))
    segment_bytes = draw(st.sampled_from([2, 4]))
    segments = draw(st.integers(8, 20))
    segment_stride = rows_per_block * segment_bytes + draw(st.sampled_from([0, 0, 2, 6]))
    row_extent = (segments - 1) * segment_stride + segment_bytes
    return PlaneGeometry(
        num_blocks=draw(st.integers(1, max_blocks)),
        block_stride=(rows_per_block - 1) * segment_bytes + row_extent + draw(st.sampled_from([0, 0, 4])),
        rows_per_block=rows_per_block,
        row_stride=segment_bytes,
        segments=segments,
        segment_bytes=segment_bytes,
        segment_stride=segment_stride,
    )


@st.composite
def interleaved_cases(draw) -> tuple[list[Plane], torch.Tensor]:
    """One or two transposed-K planes and slots as a chunk of whole blocks gives them: each block's rows from
    some row to its end, blocks in random order, now and then a hole."""
    geometry = draw(interleaved_geometries())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    planes = [
        Plane(f"layer{i}", "k", 0, torch.uint8, geometry, 0,
              storage_of(torch.randint(0, 256, (geometry.span_bytes,), dtype=torch.uint8, generator=gen)))
        for i in range(draw(st.integers(1, 2)))
    ]
    slots: list[int] = []
    for block in draw(st.permutations(range(geometry.num_blocks))):
        first = draw(st.sampled_from([0, 0, draw(st.integers(0, geometry.rows_per_block - 1))]))
        slots += [block * geometry.rows_per_block + row for row in range(first, geometry.rows_per_block)]
    for hole in draw(st.lists(st.integers(0, len(slots) - 1), max_size=2)):
        slots[hole] = -1
    return planes, torch.tensor(slots, dtype=torch.int64)


@st.composite
def transfer_cases(draw, max_planes: int = 4, max_rows: int = 12) -> tuple[list[Plane], torch.Tensor]:
    """(planes with random bytes, int64 slots ``[R]`` or ``[P, R]``) with distinct valid slots per plane."""
    geoms = draw(st.lists(geometries(), min_size=1, max_size=max_planes))
    shared = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    gaps = [draw(st.integers(0, 7)) for _ in geoms]
    planes: list[Plane] = []
    if shared:
        total = sum(g.span_bytes + gap for g, gap in zip(geoms, gaps, strict=True))
        storage = storage_of(torch.randint(0, 256, (total + 3,), dtype=torch.uint8, generator=gen))
    offset = 0
    for index, (g, gap) in enumerate(zip(geoms, gaps, strict=True)):
        if not shared:
            storage = storage_of(torch.randint(0, 256, (g.span_bytes + gap,), dtype=torch.uint8, generator=gen))
            offset = 0
        planes.append(Plane(f"layer{index}", f"plane{index}", 0, torch.uint8, g, offset + gap, storage))
        offset += g.span_bytes + gap
    rows = draw(st.integers(0, max_rows))
    per_plane = draw(st.booleans())
    capacities = [g.num_slots for g in geoms] if per_plane else [min(g.num_slots for g in geoms)]
    lists = [draw(slot_lists(capacity, rows)) for capacity in capacities]
    slots = torch.tensor(lists, dtype=torch.int64).reshape(len(lists), rows)
    return planes, slots if per_plane else slots[0]


@st.composite
def chunk_cases(draw, max_planes: int = 4, max_rows: int = 12) -> tuple[list[Plane], torch.Tensor, int]:
    """(planes, slots ``[N, R]`` or ``[N, P, R]``, gap): a ``transfer_cases`` slot list cut into N chunks of R
    rows (no valid slot in two chunks), and the bytes left free between chunks in the batch buffer."""
    planes, slots = draw(transfer_cases(max_planes, max_rows))
    rows = slots.shape[-1]
    chunks = draw(st.sampled_from([n for n in (1, 2, 3) if rows % n == 0]))
    per_chunk = rows // chunks
    if slots.dim() == 1:
        batched = slots.reshape(chunks, per_chunk)
    else:
        batched = slots.reshape(len(planes), chunks, per_chunk).transpose(0, 1).contiguous()
    return planes, batched, draw(st.integers(0, 9))


@st.composite
def slot_lists(draw, capacity: int, rows: int) -> list[int]:
    """``rows`` slots below ``capacity``: distinct when valid, -1 holes, runs of consecutive slots often."""
    if draw(st.booleans()):
        start = draw(st.integers(0, capacity - 1))
        picked = [(start + i) % capacity for i in range(min(rows, capacity))]
    else:
        picked = draw(st.permutations(range(capacity)))[:rows]
    picked = picked + [-1] * (rows - len(picked))
    holes = draw(st.lists(st.booleans(), min_size=rows, max_size=rows))
    return [-1 if hole and draw(st.booleans()) else s for s, hole in zip(picked, holes, strict=True)]


def clone_planes(planes: Sequence[Plane]) -> list[Plane]:
    """Planes over fresh copies of their allocations (planes sharing one allocation still share the copy)."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for plane in planes:
        key = plane.storage.untyped_storage().data_ptr()
        if key not in copies:
            copies[key] = plane.storage.clone()
        out.append(dataclasses.replace(plane, storage=copies[key]))
    return out


def on_device(planes: Sequence[Plane], slots: torch.Tensor, device: torch.device) -> tuple[list[Plane], torch.Tensor]:
    """The planes over copies of their allocations on ``device`` (shared ones still shared), and the slots."""
    copies: dict[int, torch.Tensor] = {}
    out = []
    for plane in planes:
        key = plane.storage.untyped_storage().data_ptr()
        if key not in copies:
            copies[key] = plane.storage.to(device)
        out.append(dataclasses.replace(plane, storage=copies[key]))
    return out, slots.to(device)


def allocations(planes: Sequence[Plane]) -> list[torch.Tensor]:
    """Each distinct allocation behind the planes once, in first-use order."""
    seen: dict[int, torch.Tensor] = {}
    for plane in planes:
        seen.setdefault(plane.storage.untyped_storage().data_ptr(), plane.storage)
    return list(seen.values())


def random_buffer(planes: Sequence[Plane], rows: int, seed: int) -> torch.Tensor:
    """A chunk buffer of the right size filled with random bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (buffer_bytes(planes, rows),), dtype=torch.uint8, generator=gen)
