"""Chunk parts: which transfer groups of a chunk are stored together, and which chunks a hit needs of each.

A sliding-window group resumed after a hit of N tokens reads only rows of its last ``sliding_window`` tokens,
and a snapshot group only the snapshot at N; full attention reads every row. Storing each kind under its own
key per chunk (a *part*) lets a load fetch the window part of the last few chunks only, instead of every
group of every chunk. A part is the set of saved groups sharing one *reach*: the tokens before a hit's end
whose chunks it needs (None: all of them). A hit stays all-or-nothing across groups: it counts only when
every chunk each part needs for it is present (``longest_hit``).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.kv_layout import KVLayout

Presence = Sequence[bool] | Callable[[int], bool]


@dataclass(frozen=True)
class ChunkPart:
    """Transfer groups (``KVLayout.transfer_groups`` indices) stored under one key per chunk."""

    index: int
    name: str
    reach: int | None
    transfer_groups: tuple[int, ...]
    bytes_per_chunk: int
    snapshots: bool = False
    """It carries a snapshot group: a chunk's object of this part exists only where the state was kept."""


def group_reach(group: KVGroup) -> int | None:
    """Tokens before a hit's end whose rows this group still reads, as its kind says: its window, 1 for a
    snapshot group (only the state at the hit point), None for full attention (every row)."""
    return group.kind.reach(group)


def _part_name(reach: int | None) -> str:
    return "all" if reach is None else f"reach{reach}"


def chunk_parts(layout: KVLayout) -> tuple[ChunkPart, ...]:
    """One part per distinct reach among the saved groups, full attention first, then widest reach first.

    A layout whose groups all share one reach (one group, or no window or snapshot group) gets one part: its
    chunks keep the one-object format.
    """
    by_reach: dict[int | None, list[int]] = {}
    for tg in layout.transfer_groups:
        by_reach.setdefault(group_reach(layout.group(tg.group)), []).append(tg.index)
    order = sorted(by_reach, key=lambda reach: (reach is not None, -(reach or 0)))
    return tuple(
        ChunkPart(i, _part_name(reach), reach, tuple(by_reach[reach]),
                  sum(layout.transfer_groups[t].bytes_per_chunk for t in by_reach[reach]),
                  any(layout.group(layout.transfer_groups[t].group).kind.snapshots for t in by_reach[reach]))
        for i, reach in enumerate(order)
    )


def needs_chunk(reach: int | None, chunk_end: int, hit_tokens: int) -> bool:
    """Whether a part of this reach needs the chunk ending at ``chunk_end`` to resume after ``hit_tokens``:
    a chunk inside the hit holding a token at or after ``hit_tokens - reach``."""
    if chunk_end > hit_tokens or chunk_end <= 0:
        return False
    return reach is None or chunk_end > hit_tokens - reach


def chunk_ends(num_tokens: int, chunk_size: int) -> list[int]:
    """Where the chunks of ``num_tokens`` tokens end (the last one may be partial)."""
    if chunk_size <= 0 or num_tokens < 0:
        raise LayoutError(f"bad chunking: {num_tokens} tokens in chunks of {chunk_size}")
    return [min(end, num_tokens) for end in range(chunk_size, num_tokens + chunk_size, chunk_size)]


def needed_chunks(reach: int | None, hit_tokens: int, chunk_size: int) -> list[int]:
    """Indices of the chunks a part of this reach needs for a hit of ``hit_tokens``."""
    return [i for i, end in enumerate(chunk_ends(hit_tokens, chunk_size)) if needs_chunk(reach, end, hit_tokens)]


def longest_hit(present: Sequence[tuple[int | None, Presence]], ends: Sequence[int]) -> int:
    """The longest hit whose every needed chunk is present: the largest chunk end ``n`` such that, for every
    part (its reach, and whether its object of chunk ``i`` is present: a list, or a function asked lazily,
    from the last chunks back), each chunk it needs for ``n`` is there; 0 when none is. A chunk present in one
    part only never makes a hit by itself."""
    has = [flags if callable(flags) else _checked(flags, len(ends)).__getitem__ for _, flags in present]
    limit = len(ends)
    for (reach, _), ok in zip(present, has, strict=True):
        if reach is None:  # needs every chunk: the hit ends within the present prefix
            limit = next((i for i in range(limit) if not ok(i)), limit)
    for last in range(limit - 1, -1, -1):
        if all(ok(i) for (reach, _), ok in zip(present, has, strict=True) if reach is not None
               for i in range(_first_needed(reach, ends, last), last + 1)):
            return ends[last]
    return 0


def _checked(flags: Sequence[bool], count: int) -> Sequence[bool]:
    if len(flags) != count:
        raise LayoutError(f"presence of {len(flags)} chunks given for {count} chunks")
    return flags


def _first_needed(reach: int | None, ends: Sequence[int], last: int) -> int:
    """The first chunk a part of this reach needs for a hit ending with chunk ``last`` (chunks are needed
    contiguously up to ``last``)."""
    if reach is None:
        return 0
    return bisect.bisect_right(ends, ends[last] - reach, 0, last)
