"""Chunk parts: every saved byte in exactly one part, the chunks a hit needs of each part hold every row the
model reads after the hit, and the lookup rule (``longest_hit``) against a brute-force definition."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.layout import LayoutError, load_layout_spec
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.parts import chunk_ends, chunk_parts, group_reach, longest_hit, needed_chunks, needs_chunk
from lmcache_platforms.layout.slots import chunk_rows
from lmcache_platforms.tools.fixtures import plan
from tests.layout.strategies import kv_groups, layout_specs

SETTINGS = settings(max_examples=80, deadline=None)


@SETTINGS
@given(layout_specs(max_groups=4, snapshots=True))
def test_parts_split_the_chunk_without_adding_or_losing_a_byte(spec) -> None:
    layout = plan(spec)
    parts = chunk_parts(layout)
    members = sorted(t for part in parts for t in part.transfer_groups)
    assert members == [tg.index for tg in layout.transfer_groups]
    assert sum(part.bytes_per_chunk for part in parts) == layout.chunk_bytes
    reaches = {group_reach(layout.group(tg.group)) for tg in layout.transfer_groups}
    assert len(parts) == len(reaches)
    assert [p.index for p in parts] == list(range(len(parts)))
    if None in reaches:
        assert parts[0].reach is None  # full attention first: its chunks decide how long a hit can be
    windows = [p.reach for p in parts if p.reach is not None]
    assert windows == sorted(windows, reverse=True)  # then the widest reach first
    for part in parts:
        groups = [layout.group(layout.transfer_groups[t].group) for t in part.transfer_groups]
        assert {group_reach(g) for g in groups} == {part.reach}
        assert part.name == ("all" if part.reach is None else f"reach{part.reach}")
        assert part.snapshots == any(g.snapshots for g in groups)


def brute_needed_rows(group: KVGroup, hit: int) -> set[int]:
    """Rows the model reads of this group when it resumes after ``hit`` tokens: every row of full attention,
    the rows holding tokens ``[hit - window, hit)`` of a sliding window, the snapshot at ``hit``."""
    cr = group.tokens_per_row
    if group.snapshots:
        return {hit // cr - 1}
    first = 0 if group.sliding_window is None else max(0, hit - group.sliding_window)
    return set(range(first // cr, -(-hit // cr)))


@SETTINGS
@given(kv_groups(max_groups=3, snapshots=True), st.integers(1, 6))
def test_the_needed_chunks_hold_every_row_read_after_the_hit(case, hit_chunks: int) -> None:
    groups, chunk = case
    hit = hit_chunks * chunk
    for group in groups:
        stored: set[int] = set()
        for i in needed_chunks(group_reach(group), hit, chunk):
            first, count = chunk_rows(group, i * chunk, (i + 1) * chunk, chunk)
            stored.update(range(first, first + count))
        assert brute_needed_rows(group, hit) <= stored, group


@SETTINGS
@given(st.one_of(st.none(), st.integers(1, 600)), st.integers(0, 2000), st.integers(1, 300))
def test_needed_chunks_are_a_contiguous_tail_of_the_hit(reach, hit: int, chunk: int) -> None:
    chunks = needed_chunks(reach, hit, chunk)
    ends = chunk_ends(hit, chunk)
    assert chunks == list(range(len(ends) - len(chunks), len(ends)))
    assert bool(chunks) == (hit > 0)
    if reach is None:
        assert len(chunks) == len(ends)


def brute_longest_hit(present, ends) -> int:
    hits = [end for end in ends
            if all(ok for reach, flags in present for e, ok in zip(ends, flags, strict=True)
                   if needs_chunk(reach, e, end))]
    return max(hits, default=0)


@st.composite
def presence(draw):
    chunk = draw(st.integers(1, 64))
    num_tokens = draw(st.integers(0, 12 * chunk))
    ends = chunk_ends(num_tokens, chunk)
    reaches = draw(st.lists(st.one_of(st.none(), st.integers(1, 5 * chunk)), min_size=1, max_size=3))
    flags = [draw(st.lists(st.booleans(), min_size=len(ends), max_size=len(ends))) for _ in reaches]
    return list(zip(reaches, flags, strict=True)), ends


@settings(max_examples=300, deadline=None)
@given(presence())
def test_longest_hit_is_the_longest_hit_with_every_needed_chunk(case) -> None:
    present, ends = case
    assert longest_hit(present, ends) == brute_longest_hit(present, ends)


def test_an_evicted_early_window_chunk_does_not_cost_the_hit() -> None:
    """The LRU drops chunk 0's window part (never read again for longer hits); its full part stays."""
    ends = [256, 512, 768, 1024]
    assert longest_hit([(None, [True] * 4), (512, [False, True, True, True])], ends) == 1024
    # A missing window part inside the last window cuts the hit back to where every needed chunk is present.
    assert longest_hit([(None, [True] * 4), (512, [True, True, False, True])], ends) == 512
    # A missing full part ends the hit there, whatever the window parts hold.
    assert longest_hit([(None, [True, False, True, True]), (512, [True] * 4)], ends) == 256


@pytest.mark.parametrize(("name", "parts"), [
    ("gemma3", [(0, "all", None, (0,), False), (1, "reach32", 32, (1,), False)]),
    ("deepseek-v4", [(0, "all", None, (1, 2), False), (1, "reach128", 128, (0,), False)]),
    ("qwen3-next", [(0, "all", None, (3,), False), (1, "reach1", 1, (0, 1, 2), True)]),
    ("llama", [(0, "all", None, (0,), False)]),
])
def test_the_shipped_layouts_parts(name: str, parts: list[tuple]) -> None:
    got = chunk_parts(plan(load_layout_spec(name)))
    assert [(p.index, p.name, p.reach, p.transfer_groups, p.snapshots) for p in got] == parts


def test_a_groups_reach() -> None:
    assert group_reach(KVGroup(0, block_size=16)) is None
    assert group_reach(KVGroup(0, block_size=16, sliding_window=48)) == 48
    assert group_reach(KVGroup(0, block_size=1, tokens_per_row=256, snapshots=True)) == 1


def test_the_chunks_each_reach_needs() -> None:
    assert needed_chunks(None, 130, 64) == [0, 1, 2]
    assert needed_chunks(32, 256, 64) == [3]
    assert needed_chunks(100, 256, 64) == [2, 3]
    assert needed_chunks(1, 128, 64) == [1]
    assert needed_chunks(32, 0, 64) == []
    assert not needs_chunk(None, 0, 5) and not needs_chunk(None, 6, 5) and needs_chunk(None, 5, 5)


def test_bad_chunking_is_refused_in_full() -> None:
    for tokens, chunk in ((-1, 64), (10, 0), (10, -64)):
        with pytest.raises(LayoutError) as caught:
            chunk_ends(tokens, chunk)
        assert str(caught.value) == f"bad chunking: {tokens} tokens in chunks of {chunk}"
    with pytest.raises(LayoutError) as caught:
        longest_hit([(None, [True, True])], [64, 128, 192])
    assert str(caught.value) == "presence of 2 chunks given for 3 chunks"


@settings(max_examples=100, deadline=None)
@given(presence())
def test_presence_asked_lazily_gives_the_same_hit(case) -> None:
    present, ends = case
    lazy = [(reach, flags.__getitem__) for reach, flags in present]
    assert longest_hit(lazy, ends) == longest_hit(present, ends)
