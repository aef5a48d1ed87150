"""Block rows (``layout.block_rows``): a block's page moved as one row covers exactly the bytes of the block's
token rows, each once; groups and planes that do not allow it keep token rows; chunks in the two units never
share a key."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_platforms import config
from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.layout.block_rows import (
    ROW_UNITS,
    as_block_rows,
    block_row_geometry,
    block_row_group,
    merged_page,
)
from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from lmcache_platforms.tools.fixtures import layout_over, materialize, materialize_tensors
from tests.kernels.strategies import geometries, interleaved_geometries, storage_of
from tests.layout.addresses import payload_addresses


def addresses(g: PlaneGeometry, block: int, rows: range) -> list[int]:
    """Every payload byte of ``rows`` of ``block``."""
    return payload_addresses(g, (block * g.rows_per_block + r for r in rows))


@given(st.one_of(geometries(), interleaved_geometries()))
def test_a_block_row_holds_exactly_the_bytes_of_the_blocks_rows(g: PlaneGeometry) -> None:
    converted = block_row_geometry(g)
    packed = g.row_stride == g.segment_bytes or (g.segment_stride == g.segment_bytes and g.row_stride == g.row_bytes)
    if converted is None:
        assert not packed or (g.segments > 1 and g.segment_stride < g.rows_per_block * g.segment_bytes)
        return
    assert_same_bytes(g, converted)


def assert_same_bytes(g: PlaneGeometry, converted: PlaneGeometry) -> None:
    """The oracle: block ``b``'s one row holds each byte of its token rows exactly once."""
    assert converted.rows_per_block == 1 and converted.num_slots == g.num_blocks
    assert converted.row_bytes == g.rows_per_block * g.row_bytes
    for block in range(g.num_blocks):
        mine = addresses(converted, block, range(1))
        assert len(set(mine)) == len(mine)
        assert sorted(mine) == sorted(addresses(g, block, range(g.rows_per_block)))


@pytest.mark.parametrize("fault", ["one segment short", "segments a byte apart"])
def test_the_oracle_catches_a_wrong_page(fault: str) -> None:
    """Negative control: pages that drop or misplace bytes fail ``assert_same_bytes``."""
    v_heads = PlaneGeometry(num_blocks=3, block_stride=256, rows_per_block=4, row_stride=8, segments=4,
                            segment_bytes=8, segment_stride=64)
    right = block_row_geometry(v_heads)
    assert right is not None
    assert_same_bytes(v_heads, right)
    wrong = (dataclasses.replace(right, segments=3) if fault == "one segment short"
             else dataclasses.replace(right, segment_stride=right.segment_stride + 1))
    with pytest.raises(AssertionError):
        assert_same_bytes(v_heads, wrong)


def test_rows_with_gaps_between_them_keep_token_rows() -> None:
    padded = PlaneGeometry(4, 64, 4, 12, 1, 10, 10)
    scattered = PlaneGeometry(4, 96, 4, 4, 2, 4, 8)  # two segments per row, rows interleaved across them
    assert block_row_geometry(padded) is None
    assert block_row_geometry(scattered) is None


def test_transposed_k_of_one_head_is_one_dense_page() -> None:
    k_head = PlaneGeometry(num_blocks=8, block_stride=65536, rows_per_block=32, row_stride=2, segments=128,
                           segment_bytes=2, segment_stride=64)
    assert block_row_geometry(k_head) == PlaneGeometry(8, 65536, 1, 0, 1, 8192, 0)


@pytest.mark.parametrize(("group", "why"), [
    (KVGroup(0, block_size=16, sliding_window=None), "chunk 40 is not a multiple of the 16-token block"),
    (KVGroup(0, block_size=1, tokens_per_row=8, is_state=True, snapshots=True), "snapshots are one row per block"),
])
def test_groups_a_chunk_or_window_would_cut_keep_token_rows(group: KVGroup, why: str) -> None:
    assert block_row_group(group, 40) is None, why


def test_a_group_converts_to_one_row_per_block() -> None:
    group = KVGroup(0, block_size=4, tokens_per_row=2, sliding_window=16, spec_name="SlidingWindowSpec")
    assert block_row_group(group, 32) == dataclasses.replace(group, block_size=1, tokens_per_row=8)


def test_a_window_ending_inside_a_block_keeps_the_blocks_its_tokens_lie_in() -> None:
    """Chunks end on block boundaries, so a 12-token window over 8-token blocks reads tokens of 2 blocks."""
    group = KVGroup(0, block_size=8, sliding_window=12)
    converted = block_row_group(group, 40)
    assert converted == dataclasses.replace(group, block_size=1, tokens_per_row=8, sliding_window=16)
    assert converted is not None and converted.kind.rows(converted, 0, 40) == (3, 2)


def test_a_layers_k_and_v_heads_merge_into_its_page() -> None:
    layout = materialize(load_layout_spec("vllm-cpu"), rows="blocks")
    tokens = materialize(load_layout_spec("vllm-cpu"))
    assert [tg.rows_per_chunk for tg in layout.transfer_groups] == [2, 2]
    assert [tg.bytes_per_chunk for tg in layout.transfer_groups] == [tg.bytes_per_chunk
                                                                     for tg in tokens.transfer_groups]
    shared = layout.transfer_groups[0].planes
    assert [(p.layer, p.geometry.segments, p.geometry.segment_bytes) for p in shared] == [
        (f"model.layers.{i}.self_attn", 1, 2 * 2 * 32 * 64 * 2) for i in range(3)]
    assert [g.block_size for g in layout.groups] == [1, 1]


def test_pieces_with_a_gap_do_not_merge() -> None:
    storage = storage_of(torch.zeros(4096, dtype=torch.uint8))
    g = PlaneGeometry(4, 1024, 1, 0, 1, 256, 0)
    a = Plane("l", "a", 0, torch.uint8, g, 0, storage)
    b = Plane("l", "b", 0, torch.uint8, g, 512, storage)
    c = Plane("l", "c", 0, torch.uint8, g, 256, storage)
    assert merged_page([a, b]) is None
    merged = merged_page([a, b, c])
    assert merged is not None and (merged.offset, merged.geometry.segment_bytes) == (0, 768)
    other = Plane("l", "c", 0, torch.uint8, g, 256, storage_of(torch.zeros(4096, dtype=torch.uint8)))
    assert merged_page([a, other]) is None  # another allocation


def test_one_saved_group_keeps_token_rows() -> None:
    """A single group may save a partial last chunk, which ends inside a block."""
    spec = load_layout_spec("llama")
    layout = materialize(spec, rows="blocks")
    assert layout.groups == materialize(spec).groups


def test_a_group_with_an_unpackable_plane_keeps_token_rows() -> None:
    group = KVGroup(0, block_size=4)
    storage = storage_of(torch.zeros(1024, dtype=torch.uint8))
    planes = [Plane("l", "k", 0, torch.uint8, PlaneGeometry(4, 64, 4, 12, 1, 10, 10), 0, storage)]
    assert as_block_rows(group, planes, 8) is None


def test_chunks_in_the_two_units_never_share_a_key() -> None:
    spec = load_layout_spec("vllm-cpu")
    tensors = materialize_tensors(spec, "cpu", 0)
    blocks, tokens = (paged_format(layout_over(spec, tensors, rows=rows)) for rows in ("blocks", "tokens"))
    assert blocks.nbytes == tokens.nbytes
    assert blocks.fingerprint != tokens.fingerprint


def test_the_setting_and_the_layout_name_the_same_units() -> None:
    assert config.CHUNK_ROWS == ROW_UNITS
    assert config.PlatformSettings.load(env={}).chunk_rows == "blocks"
    with pytest.raises(ValueError, match=r"platforms\.chunk_rows must be one of blocks, tokens, got 'pages'"):
        config.PlatformSettings.load(env={"LMCACHE_PLATFORMS_CHUNK_ROWS": "pages"})
    with pytest.raises(LayoutError, match="rows must be one of blocks, tokens, got 'pages'"):
        materialize(load_layout_spec("vllm-cpu"), rows="pages")


# What mutation testing (``make mutation``) found unread: the merged plane itself, and each reason not to merge
# or convert on its own.


def test_a_merged_page_is_one_row_per_block_over_exactly_the_pieces_it_tiles() -> None:
    storage = storage_of(torch.zeros(4096, dtype=torch.uint8))
    g = PlaneGeometry(4, 1024, 1, 0, 1, 256, 0)
    k, v, w = (Plane("l", name, 0, torch.bfloat16, g, offset, storage)
               for name, offset in (("k", 512), ("v", 256), ("w", 768)))
    assert merged_page([k, v, w]) == Plane("l", "k+2", 0, torch.bfloat16, PlaneGeometry(4, 1024, 1, 0, 1, 768, 0),
                                           256, storage)
    mixed = dataclasses.replace(v, dtype=torch.float16)
    assert merged_page([k, mixed]) == Plane("l", "k+1", 0, torch.uint8, PlaneGeometry(4, 1024, 1, 0, 1, 512, 0),
                                            256, storage)


def test_pieces_that_do_not_share_a_block_shape_or_fit_in_a_block_do_not_merge() -> None:
    storage = storage_of(torch.zeros(8192, dtype=torch.uint8))
    g = PlaneGeometry(4, 512, 1, 0, 1, 256, 0)
    a, b = Plane("l", "a", 0, torch.uint8, g, 0, storage), Plane("l", "b", 0, torch.uint8, g, 256, storage)
    assert merged_page([a, b]) is not None
    assert merged_page([a, dataclasses.replace(b, geometry=dataclasses.replace(g, num_blocks=3))]) is None
    assert merged_page([a, dataclasses.replace(b, geometry=dataclasses.replace(g, block_stride=1024))]) is None
    c = Plane("l", "c", 0, torch.uint8, g, 512, storage)
    assert merged_page([a, b, c]) is None  # 768 bytes in a 512-byte block


@pytest.mark.parametrize(("block_size", "expected"), [(1, None), (2, KVGroup(0, block_size=1, tokens_per_row=2))])
def test_a_group_already_one_row_per_block_stays_as_it_is(block_size: int, expected: KVGroup | None) -> None:
    assert block_row_group(KVGroup(0, block_size=block_size), 32) == expected
