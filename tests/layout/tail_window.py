"""A group kind added the way a new one would be, for the tests: a sliding window written from its definition
alone (no code shared with the built-in ``SlidingWindow``), and the same with a planted fault."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from lmcache_platforms.layout import GroupKind, LayoutError
from lmcache_platforms.layout.group_kinds import GroupFields


@dataclass(frozen=True)
class TailWindow(GroupKind):
    """A sliding window from its definition: a chunk keeps each row holding one of the last ``sliding_window``
    tokens before its end; it reserves as many rows as the largest such set over the chunks it may end."""

    name: ClassVar[str] = "tail window"

    def check(self, group: GroupFields) -> None:
        if not group.sliding_window or group.sliding_window % group.tokens_per_row:
            raise LayoutError(f"{group.describe()}: a tail window needs a whole number of rows")

    def rows(self, group: GroupFields, start: int, end: int) -> tuple[int, int]:
        cr, window = group.tokens_per_row, group.sliding_window or 0
        kept = [r for r in range(start // cr, -(-end // cr)) if (r + 1) * cr > end - window]
        return (kept[0], len(kept)) if kept else (start // cr, 0)

    def rows_per_chunk(self, group: GroupFields, chunk_size: int, whole_chunks: bool) -> int:
        lengths = [chunk_size] if whole_chunks else range(1, chunk_size + 1)
        return max(self.rows(group, chunk_size, chunk_size + n)[1] for n in lengths)

    def reach(self, group: GroupFields) -> int | None:
        return group.sliding_window

    def block_rows_fit(self, group: GroupFields, chunk_size: int) -> bool:
        tokens = group.tokens_per_block
        return group.block_size > 1 and chunk_size % tokens == 0


@dataclass(frozen=True)
class TailWindowMissingItsFirstRow(TailWindow):
    """The planted fault: the row holding the window's first token is not kept."""

    def rows(self, group: GroupFields, start: int, end: int) -> tuple[int, int]:
        first, count = super().rows(group, start, end)
        return (first + 1, count - 1) if count > 1 else (first, count)
