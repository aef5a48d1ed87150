"""A model's KV cache as groups -> layers -> planes, and the transfer groups one chunk is moved in.

Bundled mode (default) packs every plane of one scheduler group into one transfer group, i.e. one kernel
launch per group per chunk; exploded mode gives each (group, plane geometry) its own launch, for kernels
that only move uniform planes. Both cover exactly the same bytes. Each transfer group is one tensor of the
chunk's MemoryObj (``TransferGroup.index``), so a hit restores all groups or none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_platforms.layout.block_rows import ROW_UNITS, as_block_rows
from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.groups import KVGroup, validate_groups
from lmcache_platforms.layout.overlap import check_layer
from lmcache_platforms.layout.plane import Plane, buffer_bytes
from lmcache_platforms.layout.slots import BlockIds, chunk_slots, chunks_slots, physical_rows_per_chunk

MODES = ("bundled", "exploded")


@dataclass(frozen=True)
class LayerEntry:
    """One layer (bundled) or one plane of a layer (exploded) and its planes."""

    name: str
    planes: tuple[Plane, ...]


@dataclass(frozen=True)
class TransferGroup:
    """Planes moved by one launch with one slot list; ``index`` is its tensor index in a chunk."""

    index: int
    group: int
    planes: tuple[Plane, ...]
    layers: tuple[str, ...]
    rows_per_chunk: int

    @property
    def row_bytes(self) -> int:
        """Bytes one row of every plane adds to the chunk buffer."""
        return buffer_bytes(self.planes, 1)

    @property
    def bytes_per_chunk(self) -> int:
        """Bytes of this group's part of a full chunk."""
        return buffer_bytes(self.planes, self.rows_per_chunk)


def _check_geometry(plane: Plane) -> None:
    g = plane.geometry
    for field in dataclasses.fields(g):
        value = getattr(g, field.name)
        positive = field.name not in ("block_stride", "row_stride", "segment_stride")
        if not isinstance(value, int) or value < 0 or (positive and value == 0):
            raise LayoutError(f"layer {plane.layer!r} plane {plane.name!r}: bad {field.name} {value!r}")
    if plane.offset < 0:
        raise LayoutError(f"layer {plane.layer!r} plane {plane.name!r}: negative offset {plane.offset}")


def _as_entries(layers: Sequence[LayerEntry] | Mapping[str, Sequence[Plane]]) -> list[LayerEntry]:
    if isinstance(layers, Mapping):
        return [LayerEntry(name, tuple(planes)) for name, planes in layers.items()]
    return [LayerEntry(e.name, tuple(e.planes)) for e in layers]


class KVLayout:
    """Validated layout plus the per-chunk transfer plan; build with ``KVLayout.build``."""

    def __init__(
        self,
        groups: tuple[KVGroup, ...],
        layers: tuple[LayerEntry, ...],
        transfer_groups: tuple[TransferGroup, ...],
        skipped_planes: tuple[Plane, ...],
        chunk_size: int,
        mode: str,
    ) -> None:
        self.groups = groups
        self.layers = layers
        self.transfer_groups = transfer_groups
        self.skipped_planes = skipped_planes
        self.chunk_size = chunk_size
        self.mode = mode
        self._by_index = {g.index: g for g in groups}
        self._whole_chunks = moves_whole_chunks(self.saved_groups, [p for tg in transfer_groups for p in tg.planes])

    @classmethod
    def build(
        cls,
        groups: Sequence[KVGroup],
        layers: Sequence[LayerEntry] | Mapping[str, Sequence[Plane]],
        chunk_size: int,
        mode: str = "bundled",
        saved: Collection[int] | None = None,
        num_blocks: Mapping[int, int] | Sequence[int] | None = None,
        rows: str = "tokens",
    ) -> KVLayout:
        """Validate and plan. ``saved``: indices of the groups chunks carry, decided by the caller (vLLM's
        ``plan_groups``, or ``saved_indices`` for a layout file); None carries every group. ``num_blocks`` (per
        group index) lets planes be checked to hold every slot. ``rows="blocks"`` moves the groups that allow
        it in block rows (``layout.block_rows``): the same bytes per chunk, in another order."""
        if mode not in MODES:
            raise LayoutError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")
        if rows not in ROW_UNITS:
            raise LayoutError(f"rows must be one of {', '.join(ROW_UNITS)}, got {rows!r}")
        validate_groups(groups, chunk_size)
        by_index = {g.index: g for g in groups}
        entries = _as_entries(layers)
        blocks = dict(enumerate(num_blocks)) if isinstance(num_blocks, Sequence) else dict(num_blocks or {})
        seen: set[str] = set()
        for entry in entries:
            if entry.name in seen:
                raise LayoutError(f"layer {entry.name!r} appears twice")
            seen.add(entry.name)
            cls._check_entry(entry, by_index, blocks)
        member: dict[int, list[str]] = {g.index: [] for g in groups}
        for entry in entries:
            for plane in entry.planes:
                if entry.name not in member[plane.group]:
                    member[plane.group].append(entry.name)
        groups = tuple(g if g.layer_names else dataclasses.replace(g, layer_names=tuple(member[g.index]))
                       for g in groups)
        if saved is None:
            saved = by_index.keys()
        _check_pages_only(entries, saved, rows)
        if rows == "blocks":
            groups, entries = _in_block_rows(groups, entries, saved, chunk_size)
            by_index = {g.index: g for g in groups}
        planes = [p for e in entries for p in e.planes]
        skipped = tuple(p for p in planes if p.group not in saved)
        kept = [p for p in planes if p.group in saved]
        if mode == "bundled":
            out_layers = tuple(entries)
        else:
            out_layers = tuple(LayerEntry(f"{p.layer}/{p.name}", (p,)) for p in planes)
        tgs = _transfer_groups(kept, by_index, chunk_size, mode)
        return cls(tuple(groups), out_layers, tgs, skipped, chunk_size, mode)

    @staticmethod
    def _check_entry(entry: LayerEntry, by_index: dict[int, KVGroup], blocks: dict[int, int]) -> None:
        names: set[str] = set()
        for plane in entry.planes:
            where = f"layer {entry.name!r} plane {plane.name!r}"
            if plane.name in names:
                raise LayoutError(f"{where}: plane name appears twice in the layer")
            names.add(plane.name)
            if plane.group not in by_index:
                raise LayoutError(f"{where}: group {plane.group} does not exist (groups {sorted(by_index)})")
            _check_geometry(plane)
            group = by_index[plane.group]
            needed = blocks.get(plane.group, 0) * group.block_size
            if plane.geometry.num_slots < needed:
                raise LayoutError(
                    f"{where}: {plane.geometry.num_slots} slots ({plane.geometry.num_blocks} blocks x "
                    f"{plane.geometry.rows_per_block} rows) cannot hold {group.describe()}'s "
                    f"{blocks[plane.group]} blocks x {group.block_size} rows"
                )
        check_layer(entry.planes)

    def group(self, index: int) -> KVGroup:
        """The group with this scheduler index."""
        try:
            return self._by_index[index]
        except KeyError:
            raise LayoutError(f"group {index} does not exist (groups {sorted(self._by_index)})") from None

    @property
    def model_layers(self) -> tuple[str, ...]:
        """The model's layer names, in order (the exploded mode names its entries per plane, ``layer/plane``)."""
        return tuple(dict.fromkeys(p.layer for entry in self.layers for p in entry.planes))

    @property
    def saved_groups(self) -> tuple[KVGroup, ...]:
        """Groups that chunks carry (those with at least one transfer group)."""
        indices = {tg.group for tg in self.transfer_groups}
        return tuple(g for g in self.groups if g.index in indices)

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one full chunk across every transfer group."""
        return sum(tg.bytes_per_chunk for tg in self.transfer_groups)

    @property
    def launches_per_chunk(self) -> int:
        return len(self.transfer_groups)

    @property
    def multi_group(self) -> bool:
        """More than one saved group: only whole chunks may be saved (a partial one is unsafe across groups)."""
        return len({tg.group for tg in self.transfer_groups}) > 1

    @property
    def whole_chunks_only(self) -> bool:
        """Only whole chunks may be saved (``moves_whole_chunks`` of what chunks carry; decided once, since every
        chunk's slots ask)."""
        return self._whole_chunks

    def chunk_slots(
        self, tg: TransferGroup, block_ids_per_group: Sequence[BlockIds], start: int, end: int
    ) -> torch.Tensor:
        """Slots (int64, ``rows_per_chunk`` long, -1 padded) of chunk ``[start, end)`` for one transfer group."""
        if tg.group >= len(block_ids_per_group):
            raise LayoutError(f"group {tg.group}: no block ids given ({len(block_ids_per_group)} lists)")
        return chunk_slots(self.group(tg.group), block_ids_per_group[tg.group], start, end, self.chunk_size,
                           self.whole_chunks_only)

    def group_chunks_slots(
        self, group: int, block_ids_per_group: Sequence[BlockIds], bounds: Sequence[tuple[int, int]]
    ) -> torch.Tensor:
        """Slots of group ``group``'s rows in each chunk of ``bounds``: ``[len(bounds), rows per chunk]``."""
        if group >= len(block_ids_per_group):
            raise LayoutError(f"group {group}: no block ids given ({len(block_ids_per_group)} lists)")
        return chunks_slots(self.group(group), block_ids_per_group[group], bounds, self.chunk_size,
                            self.whole_chunks_only)

    def summary(self) -> dict[str, Any]:
        """The plan as plain data (what ``lmcache-platforms plan --json`` prints)."""
        return {
            "mode": self.mode,
            "chunk_size": self.chunk_size,
            "transfer_groups": [
                {"group": tg.group, "planes": len(tg.planes), "layers": len(tg.layers),
                 "rows_per_chunk": tg.rows_per_chunk, "bytes_per_chunk": tg.bytes_per_chunk}
                for tg in self.transfer_groups
            ],
            "launches_per_chunk": self.launches_per_chunk,
            "skipped_planes": len(self.skipped_planes),
            "skipped_groups": sorted({p.group for p in self.skipped_planes}),
            "chunk_bytes": self.chunk_bytes,
            "multi_group": self.multi_group,
            "snapshot_groups": [g.index for g in self.saved_groups if g.kind.snapshots],
        }


def saves_whole_chunks(carried: Collection[KVGroup]) -> bool:
    """Whether chunks carrying these groups may only be saved whole: several groups (a partial chunk is unsafe
    across groups), or a group whose kind says so (snapshots exist only at block boundaries, so a partial
    chunk would carry none)."""
    return len(carried) > 1 or any(g.kind.whole_chunks_only(g) for g in carried)


def moves_whole_chunks(carried: Collection[KVGroup], planes: Iterable[Plane]) -> bool:
    """``saves_whole_chunks`` of the groups, or a plane that moves only whole block pages (a partial chunk would
    end inside one)."""
    return saves_whole_chunks(carried) or any(p.pages_only for p in planes)


def _check_pages_only(entries: Sequence[LayerEntry], saved: Collection[int], rows: str) -> None:
    """Planes whose rows are not addressable one by one need block rows."""
    for entry in entries:
        for plane in entry.planes:
            if plane.pages_only and plane.group in saved and rows != "blocks":
                raise LayoutError(f"layer {entry.name!r}: its rows can be moved only as whole block pages (vLLM's "
                                  f"CPU cache in AMX tiles), which needs block rows, not rows={rows!r}")


def _in_block_rows(groups: tuple[KVGroup, ...], entries: list[LayerEntry], saved: Collection[int],
                   chunk_size: int) -> tuple[tuple[KVGroup, ...], list[LayerEntry]]:
    """Every saved group that allows it re-described in block rows, its planes with it; only where chunks are
    saved whole (``saves_whole_chunks``), since a partial chunk ends inside a block."""
    members: dict[int, list[Plane]] = {}
    for entry in entries:
        for plane in entry.planes:
            if plane.group in saved:
                members.setdefault(plane.group, []).append(plane)
    by_index = {g.index: g for g in groups}
    if not moves_whole_chunks([by_index[i] for i in members], (p for ps in members.values() for p in ps)):
        return groups, entries
    replaced: dict[int, KVGroup] = {}
    new_planes: dict[int, list[Plane]] = {}
    for index, planes in members.items():
        converted = as_block_rows(by_index[index], planes, chunk_size)
        if converted is not None:
            replaced[index], new_planes[index] = converted
        elif any(p.pages_only for p in planes):
            plane = next(p for p in planes if p.pages_only)
            raise LayoutError(
                f"layer {plane.layer!r} ({by_index[index].describe()}): its rows can be moved only as whole block "
                f"pages, which needs the chunk size ({chunk_size}) to be a multiple of the group's "
                f"{by_index[index].tokens_per_block} tokens per block")
    out_entries = []
    for entry in entries:
        out: list[Plane] = []
        for plane in entry.planes:
            if plane.group not in replaced:
                out.append(plane)
            elif not any(p.group == plane.group for p in out):
                out += [p for p in new_planes[plane.group] if p.layer == entry.name]
        out_entries.append(LayerEntry(entry.name, tuple(out)))
    return tuple(replaced.get(g.index, g) for g in groups), out_entries


def _transfer_groups(
    planes: list[Plane], by_index: dict[int, KVGroup], chunk_size: int, mode: str
) -> tuple[TransferGroup, ...]:
    buckets: dict[tuple[Any, ...], list[Plane]] = {}
    for plane in sorted(planes, key=lambda p: p.group):
        key = (plane.group,) if mode == "bundled" else (plane.group, plane.geometry)
        buckets.setdefault(key, []).append(plane)
    whole = moves_whole_chunks({by_index[p.group] for p in planes}, planes)
    out: list[TransferGroup] = []
    for members in buckets.values():
        group = by_index[members[0].group]
        rows = physical_rows_per_chunk(group, chunk_size, whole)
        layers = tuple(dict.fromkeys(p.layer for p in members))
        out.append(TransferGroup(len(out), group.index, tuple(members), layers, rows))
    return tuple(out)
