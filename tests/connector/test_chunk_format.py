"""Chunk formats: where each launch's bytes sit in a chunk's one MemoryObj, and how layouts are told apart."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.connector.checksum import tail_bytes
from lmcache_platforms.connector.chunk_format import paged_format, split_layers, step_formats
from lmcache_platforms.kernels.contract import buffer_bytes
from lmcache_platforms.layout import example_names, load_layout_spec
from lmcache_platforms.tools.fixtures import materialize, plan


@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("name", example_names())
def test_paged_format_packs_every_transfer_group_back_to_back(name: str, mode: str) -> None:
    layout = plan(load_layout_spec(name), mode)
    fmt = paged_format(layout)
    assert [launch.tg for launch in fmt.launches] == list(layout.transfer_groups)
    offset = 0
    for launch in fmt.launches:
        assert launch.offset == offset
        assert launch.nbytes == launch.tg.bytes_per_chunk == buffer_bytes(launch.planes, launch.tg.rows_per_chunk)
        offset += launch.nbytes
    assert fmt.payload_bytes == layout.chunk_bytes
    assert fmt.dtype == torch.uint8 and fmt.shape[:3] == (1, 1, layout.chunk_size)
    # LMCache's remote connectors assert that a full chunk divides into chunk_size "tokens".
    assert fmt.nbytes % layout.chunk_size == 0
    # The stripe table and checksum trailer follow the payload, then the least padding that makes whole "tokens".
    assert 0 <= fmt.nbytes - fmt.payload_bytes - tail_bytes(fmt.payload_bytes) < layout.chunk_size


def test_fingerprint_tells_modes_and_layouts_apart_but_not_contents() -> None:
    spec = load_layout_spec("deepseek-v4-small")
    bundled = paged_format(materialize(spec, "bundled", seed=1)).fingerprint
    assert paged_format(materialize(spec, "bundled", seed=2)).fingerprint == bundled
    assert paged_format(plan(spec, "exploded")).fingerprint != bundled
    assert paged_format(plan(load_layout_spec("gemma3"))).fingerprint != bundled


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.data())
def test_split_layers_is_an_ordered_near_even_partition(count: int, data: st.DataObject) -> None:
    names = [f"l{i}" for i in range(count)]
    steps = data.draw(st.integers(1, count))
    parts = split_layers(names, steps)
    assert len(parts) == steps
    assert [n for part in parts for n in part] == names
    sizes = [len(part) for part in parts]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


def test_split_layers_refuses_more_steps_than_layers() -> None:
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 layerwise steps"):
        split_layers(["a", "b"], 3)


@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("name", ["gemma3", "deepseek-v4-small", "mla-int8"])
@pytest.mark.parametrize("steps", [1, 2, 3])
def test_step_formats_cover_every_plane_once_with_one_shape(name: str, mode: str, steps: int) -> None:
    layout = plan(load_layout_spec(name), mode)
    formats = step_formats(layout, steps, torch.bfloat16)
    assert len({f.shape for f in formats}) == 1 and all(f.dtype == torch.bfloat16 for f in formats)
    moved = [(launch.tg.index, p) for f in formats for launch in f.launches for p in launch.planes]
    assert sorted(moved, key=str) == sorted(((tg.index, p) for tg in layout.transfer_groups for p in tg.planes),
                                            key=str)
    assert sum(f.payload_bytes for f in formats) == layout.chunk_bytes
    assert all(f.payload_bytes + tail_bytes(f.payload_bytes) <= f.nbytes for f in formats)
    assert formats[0].nbytes % (layout.chunk_size * 2) == 0
