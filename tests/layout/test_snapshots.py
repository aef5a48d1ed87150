"""Snapshot groups (recurrent state kept per block): which snapshot a chunk carries, and the layout rules,
against a brute-force model in which block ``b`` holds the state after ``(b + 1) * block tokens`` tokens."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.layout import LayoutError
from lmcache_platforms.layout.groups import KVGroup, is_saved, validate_groups
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.slots import chunk_rows, chunk_slots, physical_rows_per_chunk
from lmcache_platforms.layout.tensors import planes_from_dims

SETTINGS = settings(max_examples=80, deadline=None)


@st.composite
def snapshot_case(draw):
    """A snapshot group (block of ``bt`` tokens), a chunk of ``k`` blocks, a request and its block table."""
    block_tokens = draw(st.sampled_from((1, 2, 4, 16, 256)))
    chunk = block_tokens * draw(st.integers(1, 4))
    num_tokens = draw(st.integers(1, 5 * chunk))
    num_blocks = -(-num_tokens // block_tokens)
    ids = draw(st.lists(st.integers(0, 50), min_size=num_blocks, max_size=num_blocks))
    group = KVGroup(0, block_size=1, tokens_per_row=block_tokens, is_state=True, snapshots=True)
    return group, chunk, num_tokens, ids


def brute_snapshot_block(ids: list[int], block_tokens: int, end: int) -> int | None:
    """The block holding the state after ``end`` tokens, or None when no snapshot can exist there."""
    if end % block_tokens or end == 0:
        return None
    return ids[end // block_tokens - 1]


@SETTINGS
@given(snapshot_case())
def test_a_chunk_carries_the_snapshot_at_its_end(case):
    group, chunk, num_tokens, ids = case
    assert physical_rows_per_chunk(group, chunk) == 1
    for start in range(0, num_tokens, chunk):
        end = min(start + chunk, num_tokens)
        block = brute_snapshot_block(ids, group.tokens_per_row, end)
        assert chunk_rows(group, start, end, chunk)[1] == (block is not None)
        slots = chunk_slots(group, ids, start, end, chunk).tolist()
        expected = -1 if block in (None, 0) else block  # one row per block: slot == block id; null block: -1
        assert slots == [expected]


@SETTINGS
@given(snapshot_case())
def test_restoring_any_chunk_prefix_needs_only_its_last_chunk_snapshot(case):
    """A hit of whole chunks [0, e) resumes from the state after e tokens, which is exactly what the last
    chunk carries; no earlier chunk carries it."""
    group, chunk, num_tokens, _ = case
    for end in range(chunk, num_tokens - num_tokens % chunk + 1, chunk):
        carriers = [c0 for c0 in range(0, end, chunk)
                    if chunk_rows(group, c0, c0 + chunk, chunk) == (end // group.tokens_per_row - 1, 1)]
        assert carriers == [end - chunk]


def test_snapshot_groups_are_saved_by_default_unless_listed_to_skip():
    group = KVGroup(0, block_size=1, tokens_per_row=256, is_state=True, spec_name="MambaSpec", snapshots=True)
    assert is_saved(group, state_markers=("Mamba",))
    assert not is_saved(group, skip_groups=("MambaSpec",))


@pytest.mark.parametrize(("group", "message"), [
    (KVGroup(2, block_size=4, tokens_per_row=64, snapshots=True, spec_name="MambaSpec"),
     r"group 2 \(MambaSpec\): a snapshot group has one row per block .* block_size 4"),
    (KVGroup(2, block_size=1, tokens_per_row=64, sliding_window=64, snapshots=True),
     r"group 2: a snapshot group .* sliding_window 64"),
    (KVGroup(2, block_size=1, tokens_per_row=96, snapshots=True),
     r"group 2: tokens_per_row 96 does not divide chunk_size 64"),
])
def test_invalid_snapshot_groups_name_the_group(group, message):
    with pytest.raises(LayoutError, match=message):
        validate_groups([group], 64)


def test_layout_moves_every_state_plane_one_row_per_chunk_whole_chunks_only():
    """Conv and SSM planes of their own dtypes and shapes, in one padded page per block (as vLLM allocates)."""
    blocks, page = 6, 4096
    buffer = torch.zeros(blocks * page, dtype=torch.int8)
    conv = buffer.view(blocks, page)[:, :3 * 64 * 2].view(torch.bfloat16).view(blocks, 3, 64)
    ssm = buffer.view(blocks, page)[:, 512:512 + 2 * 8 * 8 * 4].view(torch.float32).view(blocks, 2, 8, 8)
    planes = (planes_from_dims("l0", 0, conv.unsqueeze(1), ("nb", "bs", "k", "c"), "conv")
              + planes_from_dims("l0", 0, ssm.unsqueeze(1), ("nb", "bs", "h", "k", "v"), "ssm"))
    group = KVGroup(0, block_size=1, tokens_per_row=16, is_state=True, snapshots=True)
    layout = KVLayout.build([group], {"l0": planes}, chunk_size=32, num_blocks=[blocks])
    (tg,) = layout.transfer_groups
    assert tg.rows_per_chunk == 1 and tg.bytes_per_chunk == 3 * 64 * 2 + 2 * 8 * 8 * 4
    assert {p.dtype for p in tg.planes} == {torch.bfloat16, torch.float32}
    assert layout.whole_chunks_only and not layout.multi_group
    assert layout.summary()["snapshot_groups"] == [0]
    assert layout.chunk_slots(tg, [[3, 5, 0, 2]], 0, 32).tolist() == [5]
    assert layout.chunk_slots(tg, [[3, 5, 0, 2]], 32, 64).tolist() == [2]
