"""Kinds of KV-cache group: what full attention, a sliding window, a state and per-block state snapshots each
mean for chunks, one class per kind.

Everything that differs between kinds is answered here, so the rest of the package asks a group's kind
(``KVGroup.kind``) instead of branching on its fields: which rows a chunk stores, how many rows it reserves,
how far back a hit still reads the group (its reach, which decides the chunk parts), whether it is saved when
no setting names it, whether chunks carrying it may only be saved whole, whether its rows may be re-described
as whole blocks, and whether its rows exist only where a vLLM step ended. A new kind is one subclass; a group
takes it through ``KVGroup(kind=...)``. ``tests/layout/tail_window.py`` is a sliding window written from its
definition that way; ``tests/connector/test_added_group_kind.py`` runs it through a real LMCache engine beside
the built-in one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Protocol

from lmcache_platforms.layout.errors import LayoutError


class GroupFields(Protocol):
    """What a kind reads of a group: ``groups.KVGroup`` has it, and the kinds need not import that module."""

    @property
    def block_size(self) -> int: ...
    @property
    def tokens_per_row(self) -> int: ...
    @property
    def sliding_window(self) -> int | None: ...
    @property
    def tokens_per_block(self) -> int: ...
    def describe(self) -> str: ...


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _window(group: GroupFields) -> int:
    """The window of a group whose kind reads one (``SlidingWindow.check`` refuses a group without)."""
    assert group.sliding_window is not None, group.describe()
    return group.sliding_window


@dataclass(frozen=True)
class GroupKind:
    """Full attention: a chunk stores every row whose first token lies in it, and a hit reads every chunk."""

    name: ClassVar[str] = "full attention"
    saved_by_default: ClassVar[bool] = True
    """Saved unless a setting skips it (states are not: resuming at a chunk boundary does not need them)."""
    snapshots: ClassVar[bool] = False
    """Its rows are per-block snapshots of a recurrent state: a chunk carries one only where a vLLM step ended
    at the chunk's end, loads redirect it to the block vLLM resumes from, and chunks are saved whole only."""

    def check(self, group: GroupFields) -> None:
        """Raise LayoutError naming the group when its fields do not fit this kind."""
        if group.sliding_window is not None:
            raise LayoutError(f"{group.describe()}: a {self.name} group has no sliding window, "
                              f"got {group.sliding_window}")

    def rows(self, group: GroupFields, start: int, end: int) -> tuple[int, int]:
        """(first_row, num_rows) chunk ``[start, end)`` stores: the rows whose first token lies in it."""
        first = start // group.tokens_per_row
        return first, _ceil_div(end, group.tokens_per_row) - first

    def rows_per_chunk(self, group: GroupFields, chunk_size: int, whole_chunks: bool) -> int:
        """Rows one chunk reserves (``whole_chunks``: every chunk end is a multiple of the chunk size)."""
        return _ceil_div(chunk_size, group.tokens_per_row)

    def reach(self, group: GroupFields) -> int | None:
        """Tokens before a hit's end whose chunks a load of this group reads; None: all of them."""
        return None

    def whole_chunks_only(self, group: GroupFields) -> bool:
        """Whether chunks carrying this group may only be saved whole, even alone in its layout."""
        return self.snapshots

    def block_rows_fit(self, group: GroupFields, chunk_size: int) -> bool:
        """Whether chunks hold whole blocks of this group, so each block's page can move as one row."""
        return group.block_size > 1 and chunk_size % group.tokens_per_block == 0


@dataclass(frozen=True)
class FullAttention(GroupKind):
    """Full attention (``GroupKind``'s answers)."""


@dataclass(frozen=True)
class SlidingWindow(GroupKind):
    """Attention over the last ``sliding_window`` tokens: a chunk keeps only the rows holding a token at or
    after ``end - sliding_window`` (when a partial chunk ends inside a compressed row, the row holding that token
    starts before the window), and a hit reads only the chunks its window reaches."""

    name: ClassVar[str] = "sliding window"

    def check(self, group: GroupFields) -> None:
        window = group.sliding_window
        if window is None or window <= 0:
            raise LayoutError(f"{group.describe()}: sliding_window must be positive, got {window}")
        if window % group.tokens_per_row:
            raise LayoutError(f"{group.describe()}: tokens_per_row {group.tokens_per_row} does not divide "
                              f"sliding_window {window}")

    def rows(self, group: GroupFields, start: int, end: int) -> tuple[int, int]:
        """At least the row holding the chunk's last token: the window is positive (``check``)."""
        cr = group.tokens_per_row
        first = max(start // cr, (end - _window(group)) // cr)
        return first, _ceil_div(end, cr) - first

    def rows_per_chunk(self, group: GroupFields, chunk_size: int, whole_chunks: bool) -> int:
        """The window's rows, and one more for compressed rows unless chunks are saved whole: a partial chunk
        ending inside a row needs the row holding the window's first token too."""
        cr = group.tokens_per_row
        misaligned_end = int(cr > 1 and not whole_chunks)
        return min(_ceil_div(chunk_size, cr), max(1, _window(group) // cr) + misaligned_end)

    def reach(self, group: GroupFields) -> int | None:
        return group.sliding_window

    def block_rows_fit(self, group: GroupFields, chunk_size: int) -> bool:
        """A window that ends inside a block still reads whole blocks: in block rows it keeps the blocks holding
        any of its tokens (``block_row_group`` rounds it up)."""
        return super().block_rows_fit(group, chunk_size)


@dataclass(frozen=True)
class State(GroupKind):
    """A state group (vLLM's Mamba, or a spec the settings' state markers name): skipped unless
    ``platforms.save_groups`` lists it, as resuming at a chunk boundary does not need it; where it is saved, its
    rows are those of the attention its fields describe (full, or a sliding window)."""

    name: ClassVar[str] = "state"
    saved_by_default: ClassVar[bool] = False

    @staticmethod
    def _attention(group: GroupFields) -> GroupKind:
        return FullAttention() if group.sliding_window is None else SlidingWindow()

    def check(self, group: GroupFields) -> None:
        self._attention(group).check(group)

    def rows(self, group: GroupFields, start: int, end: int) -> tuple[int, int]:
        return self._attention(group).rows(group, start, end)

    def rows_per_chunk(self, group: GroupFields, chunk_size: int, whole_chunks: bool) -> int:
        return self._attention(group).rows_per_chunk(group, chunk_size, whole_chunks)

    def reach(self, group: GroupFields) -> int | None:
        return self._attention(group).reach(group)

    def block_rows_fit(self, group: GroupFields, chunk_size: int) -> bool:
        return self._attention(group).block_rows_fit(group, chunk_size)


@dataclass(frozen=True)
class Snapshots(GroupKind):
    """Per-block snapshots of a recurrent state (vLLM's Mamba groups in align mode): one row per block of
    ``tokens_per_row`` tokens, row ``r`` holding the state after ``(r + 1) * tokens_per_row`` tokens. Resuming
    at a chunk boundary needs only the snapshot there, so a chunk carries the one at its end, and none when it
    ends mid-block (no snapshot exists there)."""

    name: ClassVar[str] = "snapshot"
    snapshots: ClassVar[bool] = True

    def check(self, group: GroupFields) -> None:
        if group.block_size != 1 or group.sliding_window is not None:
            raise LayoutError(f"{group.describe()}: a snapshot group has one row per block and no sliding window, "
                              f"got block_size {group.block_size}, sliding_window {group.sliding_window}")

    def rows(self, group: GroupFields, start: int, end: int) -> tuple[int, int]:
        cr = group.tokens_per_row
        return max(0, end // cr - 1), int(end % cr == 0 and end >= cr)

    def rows_per_chunk(self, group: GroupFields, chunk_size: int, whole_chunks: bool) -> int:
        return 1

    def reach(self, group: GroupFields) -> int | None:
        """1: only the state at the hit point."""
        return 1

    def block_rows_fit(self, group: GroupFields, chunk_size: int) -> bool:
        return False


BUILT_IN_KINDS = (FullAttention, SlidingWindow, State, Snapshots)
"""The kinds a group's fields describe: a group's built-in kind is always the one its fields pick."""


def kind_from_fields(snapshots: bool, is_state: bool, sliding_window: int | None) -> GroupKind:
    """The built-in kind a group's fields describe (layout files and vLLM's specs give these fields)."""
    if snapshots:
        return Snapshots()
    if is_state:
        return State()
    return FullAttention() if sliding_window is None else SlidingWindow()
