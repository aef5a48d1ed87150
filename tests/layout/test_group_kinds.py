"""Group kinds: the built-in kind each group's fields pick, what each kind refuses, and a kind added as one
class (``tail_window``) answering as the built-in sliding window does (``tests/connector/test_added_group_kind.py``
runs it through a real LMCache engine)."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lmcache_platforms.layout import (
    FullAttention,
    GroupKind,
    KVGroup,
    LayoutError,
    SlidingWindow,
    Snapshots,
    State,
    chunk_rows,
    physical_rows_per_chunk,
)
from lmcache_platforms.layout.block_rows import block_row_group
from lmcache_platforms.layout.groups import validate_groups
from tests.layout.tail_window import TailWindow


def test_the_fields_pick_the_built_in_kind_and_a_given_kind_stays() -> None:
    assert KVGroup(0, 16).kind == FullAttention()
    assert KVGroup(0, 16, sliding_window=32).kind == SlidingWindow()
    assert KVGroup(0, 16, is_state=True).kind == State()
    windowed_state = KVGroup(0, 16, is_state=True, sliding_window=32)
    assert windowed_state.kind == State() and not windowed_state.kind.saved_by_default
    assert chunk_rows(windowed_state, 64, 128, 64) == (96, 32) and windowed_state.kind.reach(windowed_state) == 32
    compressed_state = KVGroup(0, 4, tokens_per_row=4, is_state=True, sliding_window=32)
    assert [physical_rows_per_chunk(compressed_state, 64, whole) for whole in (True, False)] == [8, 9]
    assert block_row_group(windowed_state, 64) is not None
    rounded = block_row_group(dataclasses.replace(windowed_state, sliding_window=24), 64)
    assert rounded is not None and rounded.sliding_window == 32  # the window's tokens lie in 2 blocks
    assert block_row_group(windowed_state, 40) is None
    assert KVGroup(0, 1, tokens_per_row=16, is_state=True, snapshots=True).kind == Snapshots()
    # A built-in kind always follows the fields, also through dataclasses.replace; another kind given is kept.
    assert dataclasses.replace(KVGroup(0, 16, sliding_window=32), sliding_window=None).kind == FullAttention()
    assert KVGroup(0, 16, sliding_window=32, kind=FullAttention()).kind == SlidingWindow()
    given_kind = KVGroup(0, 16, sliding_window=32, kind=TailWindow())
    assert given_kind.kind == TailWindow() != SlidingWindow()
    assert dataclasses.replace(given_kind, block_size=1, tokens_per_row=16).kind == TailWindow()


@pytest.mark.parametrize(("group", "message"), [
    (KVGroup(2, 16, is_state=True, sliding_window=-32, spec_name="MambaSpec"),
     "group 2 (MambaSpec): sliding_window must be positive, got -32"),
    (KVGroup(0, 16, sliding_window=32, kind=GroupKind()), "group 0: a full attention group has no sliding "
                                                          "window, got 32"),
    (KVGroup(1, 16, sliding_window=0), "group 1: sliding_window must be positive, got 0"),
    (KVGroup(1, 4, tokens_per_row=4, sliding_window=6), "group 1: tokens_per_row 4 does not divide sliding_window 6"),
    (KVGroup(3, 2, tokens_per_row=16, snapshots=True), "group 3: a snapshot group has one row per block and no "
                                                       "sliding window, got block_size 2, sliding_window None"),
    (KVGroup(1, 16, kind=TailWindow()), "group 1: a tail window needs a whole number of rows"),
])
def test_each_kind_refuses_the_fields_it_cannot_have(group: KVGroup, message: str) -> None:
    with pytest.raises(LayoutError) as caught:
        validate_groups([group], 64)
    assert str(caught.value) == message


@given(cr=st.sampled_from([1, 2, 4, 8]), rows_in_window=st.integers(1, 40), chunks_in=st.integers(0, 5),
       rows_per_chunk=st.integers(1, 16), length=st.integers(1, 128), whole=st.booleans())
def test_the_added_kind_answers_as_the_built_in_sliding_window(cr: int, rows_in_window: int, chunks_in: int,
                                                                rows_per_chunk: int, length: int,
                                                                whole: bool) -> None:
    chunk = cr * rows_per_chunk
    window = cr * rows_in_window
    start, end = chunks_in * chunk, chunks_in * chunk + min(length, chunk)
    built_in = KVGroup(1, 4, tokens_per_row=cr, sliding_window=window)
    added = dataclasses.replace(built_in, kind=TailWindow())
    assert chunk_rows(added, start, end, chunk) == chunk_rows(built_in, start, end, chunk)
    assert physical_rows_per_chunk(added, chunk, whole) == physical_rows_per_chunk(built_in, chunk, whole)
    converted = block_row_group(added, chunk)
    assert (converted is None) == (block_row_group(built_in, chunk) is None)
