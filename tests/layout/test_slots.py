"""Slot math against a brute-force per-token model of vLLM's block tables."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from hypothesis import find, given, settings
from hypothesis import strategies as st

from lmcache_platforms.layout import LayoutError
from lmcache_platforms.layout import slots as slot_math
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.parts import group_reach, needed_chunks
from lmcache_platforms.layout.slots import (
    chunk_rows,
    chunk_slots,
    chunks_slots,
    physical_rows_per_chunk,
    rows_for_tokens,
    slot_mapping,
)
from tests.layout.strategies import block_table, kv_groups

SETTINGS = settings(max_examples=60, deadline=None)


def brute_slot_of_row(group: KVGroup, ids: list[int], row: int) -> int:
    """Token-level model: the row's first token decides its block; the null block has no storage."""
    first_token = row * group.tokens_per_row
    tokens_per_block = group.block_size * group.tokens_per_row
    block = ids[first_token // tokens_per_block]
    return -1 if block == 0 else block * group.block_size + row % group.block_size


def brute_rows(group: KVGroup, num_tokens: int) -> list[int]:
    return sorted({t // group.tokens_per_row for t in range(num_tokens)})


def brute_chunk_rows(group: KVGroup, start: int, end: int) -> list[int]:
    """Rows holding a token of the chunk (of its window tail for a sliding group); ``start`` is a row start."""
    low = start if group.sliding_window is None else max(start, end - group.sliding_window)
    return sorted({t // group.tokens_per_row for t in range(low, end)})


@st.composite
def group_and_table(draw):
    groups, chunk = draw(kv_groups(max_groups=1))
    group = groups[0]
    num_tokens = draw(st.integers(1, 4 * chunk))
    ids = draw(block_table(group, num_tokens))
    return group, chunk, num_tokens, ids


@SETTINGS
@given(group_and_table(), st.booleans())
def test_slot_mapping_matches_per_token_model(case, as_tensor):
    group, _, num_tokens, ids = case
    rows = brute_rows(group, num_tokens)
    assert rows_for_tokens(num_tokens, group) == len(rows)
    got = slot_mapping(group, torch.tensor(ids) if as_tensor else ids, len(rows))
    assert got.dtype == torch.int64
    assert got.tolist() == [brute_slot_of_row(group, ids, r) for r in rows]


@SETTINGS
@given(group_and_table())
def test_chunk_slots_match_per_token_model(case):
    group, chunk, num_tokens, ids = case
    physical = physical_rows_per_chunk(group, chunk)
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        rows = brute_chunk_rows(group, start, end)
        first, count = chunk_rows(group, start, end, chunk)
        assert list(range(first, first + count)) == rows
        assert count <= physical
        slots = chunk_slots(group, ids, start, end, chunk)
        assert slots.tolist() == [brute_slot_of_row(group, ids, r) for r in rows] + [-1] * (physical - count)


ChunkRows = Callable[[KVGroup, int, int, int], tuple[int, int]]


def window_gaps(rows_of: ChunkRows, group: KVGroup, chunk: int, hit: int) -> set[int]:
    """Rows attention reads when it resumes after ``hit`` stored tokens (those holding tokens ``[hit - window,
    hit)``, every row without a window) that the chunks the hit needs (``needed_chunks``, the last one partial
    when ``hit`` is not a chunk multiple) do not carry by ``rows_of``'s rule."""
    carried: set[int] = set()
    for i in needed_chunks(group_reach(group), hit, chunk):
        first, count = rows_of(group, i * chunk, min((i + 1) * chunk, hit), chunk)
        carried.update(range(first, first + count))
    low = 0 if group.sliding_window is None else max(0, hit - group.sliding_window)
    return {t // group.tokens_per_row for t in range(low, hit)} - carried


@st.composite
def group_and_hit(draw) -> tuple[KVGroup, int, int]:
    """One group (chunks of a lone group may end anywhere: a partial last chunk) and a hit of any length."""
    groups, chunk = draw(kv_groups(max_groups=1))
    return groups[0], chunk, draw(st.integers(1, 4 * chunk))


def ceil_window_chunk_rows(group: KVGroup, start: int, end: int, chunk: int) -> tuple[int, int]:
    """The old rule, the negative control: a window kept only rows whose first token is >= end - window."""
    first, stop = start // group.tokens_per_row, -(-end // group.tokens_per_row)
    if group.sliding_window is not None:
        first = max(first, -(-(end - group.sliding_window) // group.tokens_per_row))
    return first, stop - first


@SETTINGS
@given(group_and_hit())
def test_the_chunks_a_hit_needs_carry_its_whole_window_at_any_chunk_end(case):
    """Every compress ratio, window and hit end, partial last chunk included: nothing attention reads after
    the hit is missing, and each chunk's rows fit the rows it reserves."""
    group, chunk, hit = case
    assert window_gaps(chunk_rows, group, chunk, hit) == set()
    _, count = chunk_rows(group, (hit - 1) // chunk * chunk, hit, chunk)
    assert count <= physical_rows_per_chunk(group, chunk)
    if hit % chunk == 0:
        assert count <= physical_rows_per_chunk(group, chunk, whole_chunks=True)


def test_the_window_property_catches_the_old_rule():
    """Negative control: the same check over the same cases finds the row the old rule dropped, and the case
    it finds is a compressed window ending inside a row."""
    group, chunk, hit = find(group_and_hit(), lambda case: bool(window_gaps(ceil_window_chunk_rows, *case)),
                             settings=settings(database=None, max_examples=2000))
    assert group.tokens_per_row > 1 and group.sliding_window is not None
    assert (hit - group.sliding_window) % group.tokens_per_row != 0
    assert window_gaps(ceil_window_chunk_rows, group, chunk, hit) == {(hit - group.sliding_window)
                                                                     // group.tokens_per_row}


@pytest.mark.parametrize(
    ("chunk", "cr", "window", "rows"),
    [(64, 1, None, 64), (64, 4, None, 16), (64, 1, 32, 32), (64, 4, 32, 8), (64, 2, 32, 16), (64, 4, 512, 16),
     (256, 128, 128, 1)],
)
def test_physical_rows_per_chunk(chunk, cr, window, rows):
    """Whole chunks end on row boundaries; a partial chunk may end inside a compressed row, whose window then
    spans one row more (never more than the chunk's rows)."""
    group = KVGroup(0, block_size=16, tokens_per_row=cr, sliding_window=window)
    assert physical_rows_per_chunk(group, chunk, whole_chunks=True) == rows
    misaligned = cr > 1 and window is not None and window < chunk
    assert physical_rows_per_chunk(group, chunk) == rows + misaligned


@SETTINGS
@given(group_and_table(), st.data())
def test_few_slots_in_python_equal_the_tensor_path(case, data):
    """Small batches are computed in Python, big ones with tensors: both give the same slots, and the same
    error for a table too short or holding a negative id, from a tensor or a list of block ids."""
    group, chunk, num_tokens, ids = case
    ends = list(range(chunk, num_tokens + 1, chunk)) + ([num_tokens] if num_tokens % chunk else [])
    bounds = [(end - 1) // chunk * chunk for end in ends]
    bounds = list(zip(bounds, ends, strict=True))
    broken = data.draw(st.sampled_from(["none", "short", "negative"]))
    if broken == "short":
        ids = ids[:-1]
    elif broken == "negative" and ids:
        ids = [*ids[:-1], -5]
    results = []
    for threshold in (0, 10**9):
        for table in (torch.tensor(ids, dtype=torch.int64), ids):
            original, slot_math.PYTHON_SLOTS = slot_math.PYTHON_SLOTS, threshold
            try:
                results.append(chunks_slots(group, table, bounds, chunk).tolist())
            except LayoutError as exc:
                results.append(str(exc))
            finally:
                slot_math.PYTHON_SLOTS = original
    assert results == [results[0]] * 4


def test_null_blocks_map_to_minus_one():
    group = KVGroup(2, block_size=4)
    assert slot_mapping(group, [0, 7], 6).tolist() == [-1, -1, -1, -1, 28, 29]


def test_too_few_block_ids_names_the_group():
    group = KVGroup(1, block_size=4, spec_name="SlidingWindowSpec")
    with pytest.raises(LayoutError, match=r"group 1 \(SlidingWindowSpec\): row 8 needs 3 blocks .* only 2"):
        slot_mapping(group, [3, 4], 9)


@pytest.mark.parametrize(("start", "end"), [(1, 10), (0, 0), (0, 65), (-64, 0), (64, 32)])
def test_bad_chunk_ranges_are_rejected(start, end):
    with pytest.raises(LayoutError, match="is not a chunk of 64 tokens"):
        chunk_rows(KVGroup(0, block_size=16), start, end, 64)


def test_negative_block_id_is_rejected():
    with pytest.raises(LayoutError, match="negative block id -3"):
        slot_mapping(KVGroup(0, block_size=2), [1, -3], 4)


def test_no_rows_is_an_empty_int64_mapping():
    group = KVGroup(0, block_size=4)
    for ids in ([], torch.tensor([], dtype=torch.int32)):
        got = slot_mapping(group, ids, 0)
        assert (got.dtype, got.shape) == (torch.int64, torch.Size([0]))
    assert rows_for_tokens(0, group) == 0
    empty = chunks_slots(group, [3], [], 16)
    assert (empty.dtype, empty.shape) == (torch.int64, torch.Size([0, 16]))


@pytest.mark.parametrize("threshold", [0, 10**9], ids=["tensor-path", "python-path"])
def test_int32_block_tables_give_exact_int64_slots_past_two_to_the_31(threshold, monkeypatch):
    """vLLM's block tables are int32; a slot (block id x block size) may not fit in 32 bits."""
    group = KVGroup(0, block_size=32)
    big = 2**27 + 5  # x 32 rows per block: past 2**31
    ids = torch.tensor([big, 0, big + 1], dtype=torch.int32)
    expected = [big * 32 + r for r in range(32)] + [-1] * 32 + [(big + 1) * 32 + r for r in range(32)]
    assert slot_mapping(group, ids, 96).tolist() == expected
    monkeypatch.setattr(slot_math, "PYTHON_SLOTS", threshold)
    got = chunks_slots(group, ids, [(0, 64), (64, 96)], 64)
    assert got.dtype == torch.int64
    assert got.tolist() == [expected[:64], expected[64:] + [-1] * 32]


WINDOWED = KVGroup(0, block_size=16, tokens_per_row=4, sliding_window=32, spec_name="SlidingWindowSpec")


def test_whole_chunks_reserve_one_row_less_for_a_compressed_window():
    """A whole chunk's window is rows 8-15 of block 5; saved whole, a chunk reserves exactly those 8 rows,
    otherwise one more (a partial chunk may end inside a row), left -1."""
    rows = [5 * 16 + r for r in range(8, 16)]
    assert chunk_slots(WINDOWED, [5], 0, 64, 64, whole_chunks=True).tolist() == rows
    assert chunk_slots(WINDOWED, [5], 0, 64, 64).tolist() == [*rows, -1]
    assert chunks_slots(WINDOWED, [5], [(0, 64)], 64, whole_chunks=True).tolist() == [rows]
    assert chunks_slots(WINDOWED, [5], [(0, 64)], 64).tolist() == [[*rows, -1]]


def test_a_partial_chunk_ending_inside_a_row_does_not_fit_whole_chunk_rows():
    """Tokens [0, 62) end inside row 15: the window needs rows 7-15, nine, where whole chunks reserve eight."""
    assert chunk_rows(WINDOWED, 0, 62, 64) == (7, 9)
    with pytest.raises(LayoutError) as caught:
        chunks_slots(WINDOWED, [5], [(0, 62)], 64, whole_chunks=True)
    assert str(caught.value) == "group 0 (SlidingWindowSpec): a chunk of 64 tokens holds more than its 8 rows"


def test_the_slot_errors_read_in_full():
    with pytest.raises(LayoutError) as caught:
        rows_for_tokens(-1, WINDOWED)
    assert str(caught.value) == "group 0 (SlidingWindowSpec): negative token count -1"
    with pytest.raises(LayoutError) as caught:
        chunk_rows(WINDOWED, 64, 32, 64)
    assert str(caught.value) == ("group 0 (SlidingWindowSpec): [64, 32) is not a chunk of 64 tokens (start a multiple "
                                 "of the chunk size, 1 to chunk_size tokens long)")
    with pytest.raises(LayoutError) as caught:
        chunk_rows(WINDOWED, 0, 30, 30)
    assert str(caught.value) == "group 0 (SlidingWindowSpec): tokens_per_row 4 does not divide chunk_size 30"
