"""``validate_groups``: the geometry every chunk layout needs, each refusal naming the group and its value."""

from __future__ import annotations

import pytest

from lmcache_platforms.layout import LayoutError
from lmcache_platforms.layout.groups import KVGroup, validate_groups


def test_the_smallest_valid_geometry_is_accepted() -> None:
    validate_groups([KVGroup(0, block_size=1)], 1)
    validate_groups([KVGroup(0, block_size=1, sliding_window=1), KVGroup(1, block_size=2)], 2)


@pytest.mark.parametrize(("groups", "chunk", "message"), [
    ([KVGroup(0, block_size=16)], 0, "chunk_size must be positive, got 0"),
    ([KVGroup(0, block_size=16), KVGroup(0, block_size=16)], 64, "group 0: index 0 appears twice"),
    ([KVGroup(3, block_size=0, spec_name="FullAttentionSpec")], 64,
     "group 3 (FullAttentionSpec): block_size must be positive, got 0"),
    ([KVGroup(1, block_size=16, tokens_per_row=0)], 64, "group 1: tokens_per_row must be positive, got 0"),
    ([KVGroup(1, block_size=16, tokens_per_row=3)], 64, "group 1: tokens_per_row 3 does not divide chunk_size 64"),
    ([KVGroup(2, block_size=16, sliding_window=0)], 64, "group 2: sliding_window must be positive, got 0"),
    ([KVGroup(2, block_size=16, tokens_per_row=4, sliding_window=30)], 64,
     "group 2: tokens_per_row 4 does not divide sliding_window 30"),
    ([KVGroup(0, block_size=16), KVGroup(1, block_size=24)], 48,
     "group 0: block of 16 tokens does not divide the largest block (24 tokens)"),
])
def test_each_refusal_reads_in_full(groups: list[KVGroup], chunk: int, message: str) -> None:
    with pytest.raises(LayoutError) as caught:
        validate_groups(groups, chunk)
    assert str(caught.value) == message
