"""Store a layout's KV caches through LMCache, wipe them, load them back and compare every row, bit for bit.

The request is what vLLM would send: token ids and, per group, random distinct non-null block ids (groups whose
kind reads only a window get the null block 0 wherever no stored chunk keeps a row, as vLLM frees out-of-window
blocks). The
load goes to DIFFERENT random blocks with the same null pattern, so a row that lands in the wrong place is
caught. After the load, every row that must come back equals the stored one, and every other row of every
plane (null blocks, skipped state groups, unused blocks) is still zero.
Each problem names the chunk, layer and plane, how many rows are wrong, and where the first one is
(its row in the chunk, its slot, its first differing byte), so a failing kernel can be pinned down.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.plane import Plane
from lmcache_platforms.layout.slots import chunk_rows, rows_for_tokens


@dataclass
class Request:
    """Tokens and the block tables of one request, for storing and for loading back."""

    tokens: list[int]
    stored_tokens: int
    store_ids: list[torch.Tensor]
    load_ids: list[torch.Tensor]

    def chunks(self, chunk_size: int, num_tokens: int) -> list[tuple[int, int]]:
        return [(s, min(s + chunk_size, num_tokens)) for s in range(0, num_tokens, chunk_size)]


@dataclass
class Verdict:
    """What the comparison found."""

    rows_checked: int = 0
    mismatched_rows: int = 0
    touched_rows: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def bit_exact(self) -> bool:
        return not self.problems


def all_planes(layout: KVLayout) -> list[Plane]:
    return [p for tg in layout.transfer_groups for p in tg.planes] + list(layout.skipped_planes)


def _pool_size(layout: KVLayout, group: KVGroup) -> int:
    sizes = [p.geometry.num_blocks for p in all_planes(layout) if p.group == group.index]
    return min(sizes) if sizes else 0


def make_request(layout: KVLayout, num_tokens: int, seed: int = 0) -> Request:
    """Random tokens and block tables for ``num_tokens`` tokens; whole chunks only when several groups."""
    chunk = layout.chunk_size
    stored = num_tokens - num_tokens % chunk if layout.whole_chunks_only else num_tokens
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 30000, (num_tokens,), generator=gen).tolist()
    saved = {tg.group for tg in layout.transfer_groups}
    store_ids: list[torch.Tensor] = []
    load_ids: list[torch.Tensor] = []
    for group in sorted(layout.groups, key=lambda g: g.index):
        if group.index != len(store_ids):
            raise ValueError(f"group indices must be 0..{len(layout.groups) - 1}, got {group.index}")
        blocks = -(-rows_for_tokens(num_tokens, group) // group.block_size)
        pool = _pool_size(layout, group)
        if blocks > pool - 1:
            raise ValueError(f"{group.describe()}: {num_tokens} tokens need {blocks} blocks, the planes hold "
                             f"{pool} (block 0 is the null block)")
        keep = torch.ones(blocks, dtype=torch.bool)
        if group.kind.reach(group) is not None and not group.kind.snapshots and group.index in saved:
            keep[:] = False
            for start in range(0, stored, chunk):
                first, count = chunk_rows(group, start, min(start + chunk, stored), chunk)
                keep[first // group.block_size : -(-(first + count) // group.block_size)] = True
        for out in (store_ids, load_ids):
            ids = torch.randperm(pool - 1, generator=gen)[:blocks] + 1
            out.append(torch.where(keep, ids, torch.zeros_like(ids)))
    return Request(tokens, stored, store_ids, load_ids)


def _rows(plane: Plane, slots: torch.Tensor) -> torch.Tensor:
    view = plane.rows_view()
    slots = slots.to(view.device)
    return view[slots // plane.geometry.rows_per_block, slots % plane.geometry.rows_per_block].cpu()


def snapshot(layout: KVLayout, request: Request) -> dict[tuple[int, int, int], torch.Tensor]:
    """The stored rows: (chunk start, transfer group, plane position) -> bytes of rows with a real slot."""
    out = {}
    for start, end in request.chunks(layout.chunk_size, request.stored_tokens):
        for tg in layout.transfer_groups:
            slots = layout.chunk_slots(tg, request.store_ids, start, end)
            for i, plane in enumerate(tg.planes):
                out[(start, tg.index, i)] = _rows(plane, slots[slots >= 0])
    return out


def zero_planes(layout: KVLayout) -> None:
    for plane in all_planes(layout):
        plane.rows_view().zero_()


def verify(layout: KVLayout, request: Request, stored: dict[tuple[int, int, int], torch.Tensor],
           hit_tokens: int) -> Verdict:
    """Compare loaded rows with ``stored`` and check that nothing else was written."""
    verdict = Verdict()
    if hit_tokens != request.stored_tokens:
        verdict.problems.append(f"{hit_tokens} tokens hit, {request.stored_tokens} were stored")
    expected: dict[Plane, torch.Tensor] = {}
    for start, end in request.chunks(layout.chunk_size, min(hit_tokens, request.stored_tokens)):
        for tg in layout.transfer_groups:
            store_slots = layout.chunk_slots(tg, request.store_ids, start, end)
            load_slots = layout.chunk_slots(tg, request.load_ids, start, end)
            if not torch.equal(store_slots >= 0, load_slots >= 0):
                raise AssertionError("store and load block tables must share their null blocks")
            positions = torch.nonzero(load_slots >= 0).flatten().cpu()
            real = load_slots[load_slots >= 0]
            for i, plane in enumerate(tg.planes):
                got = _rows(plane, real)
                differs = (got != stored[(start, tg.index, i)]).flatten(1)
                bad_rows = torch.nonzero(differs.any(dim=1)).flatten()
                verdict.rows_checked += real.numel()
                verdict.mismatched_rows += bad_rows.numel()
                if bad_rows.numel():
                    first = int(bad_rows[0])
                    byte = int(torch.nonzero(differs[first])[0])
                    verdict.problems.append(f"chunk [{start}, {end}) layer {plane.layer!r} plane {plane.name!r}: "
                                            f"{bad_rows.numel()} of {real.numel()} rows differ, first at chunk row "
                                            f"{int(positions[first])} (slot {int(real[first])}), byte {byte}")
                mask = expected.setdefault(plane, torch.zeros(plane.geometry.num_slots, dtype=torch.bool))
                mask[real] = True
    for plane in all_planes(layout):
        rows = plane.rows_view().reshape(plane.geometry.num_slots, -1).cpu()
        mask = expected.get(plane, torch.zeros(plane.geometry.num_slots, dtype=torch.bool))
        written = torch.nonzero(~mask & rows.any(dim=1)).flatten()
        verdict.touched_rows += written.numel()
        if written.numel():
            verdict.problems.append(f"layer {plane.layer!r} plane {plane.name!r} (group {plane.group}): "
                                    f"{written.numel()} rows written that no chunk holds, first at slot "
                                    f"{int(written[0])}")
    return verdict


def summary(layout: KVLayout, request: Request, verdict: Verdict, hit_tokens: int,
            counters: Any, name: str) -> dict[str, Any]:
    """The selftest's JSON object."""
    chunk = layout.chunk_size
    return {
        "layout": name,
        "mode": layout.mode,
        "bit_exact": verdict.bit_exact,
        "rows_checked": verdict.rows_checked,
        "mismatched_rows": verdict.mismatched_rows,
        "touched_rows": verdict.touched_rows,
        "chunks_stored": counters.chunks_stored,
        "chunks_hit": -(-hit_tokens // chunk),
        "tokens_stored": request.stored_tokens,
        "tokens_hit": hit_tokens,
        "transfer_groups": len(layout.transfer_groups),
        "launches_per_chunk": layout.launches_per_chunk,
        "backend": ",".join(sorted(counters.backends)),
        "problems": verdict.problems[:10],
    }
