"""KVLayout: bundling, state skipping, plan bytes and validation errors."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings

from lmcache_platforms.layout import LayoutError
from lmcache_platforms.layout.groups import KVGroup, is_saved, saved_indices
from lmcache_platforms.layout.kv_layout import KVLayout, LayerEntry
from lmcache_platforms.layout.slots import chunk_slots, physical_rows_per_chunk
from lmcache_platforms.layout.spec import LayoutSpec
from lmcache_platforms.layout.tensors import TensorLayout, planes_from_tensor
from lmcache_platforms.tools.fixtures import materialize, plan
from tests.layout.addresses import payload_addresses
from tests.layout.strategies import layout_specs

SETTINGS = settings(max_examples=40, deadline=None)


def spec_row_bytes(spec: LayoutSpec, group: int) -> int:
    """Row bytes of one group computed from the file alone: row dims x element size, doubled by 'kv'."""
    total = 0
    for layer in spec.layers:
        for p in layer.planes:
            if p.group == group:
                row = math.prod(s for s, d in zip(p.shape, p.dims, strict=True) if d not in ("nb", "bs", "kv"))
                total += row * p.torch_dtype.itemsize * (2 if "kv" in p.dims else 1)
    return total


@SETTINGS
@given(layout_specs())
def test_plan_bytes_are_rows_times_row_bytes(spec):
    layout = plan(spec)
    carried = [g for g in spec.groups if is_saved(g) and spec_row_bytes(spec, g.index)]
    whole = len(carried) > 1 or any(g.snapshots for g in carried)
    expected = {g.index: physical_rows_per_chunk(g, spec.chunk_size, whole) * spec_row_bytes(spec, g.index)
                for g in carried}
    assert {tg.group: tg.bytes_per_chunk for tg in layout.transfer_groups} == {k: v for k, v in expected.items() if v}
    for tg in layout.transfer_groups:
        assert tg.bytes_per_chunk == tg.rows_per_chunk * sum(p.row_bytes for p in tg.planes)
    assert layout.chunk_bytes == sum(expected.values())
    assert [tg.index for tg in layout.transfer_groups] == list(range(layout.launches_per_chunk))


def byte_set(planes) -> set[int]:
    return {a for p in planes for a in payload_addresses(p.geometry, range(p.geometry.num_slots),
                                                         p.storage.data_ptr() + p.offset)}


@SETTINGS
@given(layout_specs(max_layers=2))
def test_bundled_and_exploded_cover_the_same_bytes(spec):
    bundled = materialize(spec, "bundled")
    exploded = KVLayout.build(spec.groups, bundled.layers, spec.chunk_size, "exploded", saved_indices(spec.groups),
                              num_blocks=spec.num_blocks)
    assert plan(spec, "exploded").summary() == exploded.summary()
    assert bundled.chunk_bytes == exploded.chunk_bytes
    for group in spec.groups:
        b = [p for tg in bundled.transfer_groups if tg.group == group.index for p in tg.planes]
        e = [p for tg in exploded.transfer_groups if tg.group == group.index for p in tg.planes]
        assert byte_set(b) == byte_set(e)
        assert len({p.geometry for p in b}) >= sum(tg.group == group.index for tg in exploded.transfer_groups)
    for tg in exploded.transfer_groups:
        assert len({p.geometry for p in tg.planes}) == 1
    assert sum(len(e.planes) for e in exploded.layers) == sum(len(e.planes) for e in bundled.layers)
    assert all(len(e.planes) == 1 for e in exploded.layers)
    assert [e.name for e in bundled.layers] == [layer.name for layer in spec.layers]


def small_layout(**rules) -> KVLayout:
    k = torch.zeros(6, 2, 4, 8, dtype=torch.bfloat16)
    groups = [KVGroup(0, 4, spec_name="FullAttentionSpec"), KVGroup(1, 4, sliding_window=8),
              KVGroup(2, 4, spec_name="MambaStateSpec"), KVGroup(3, 4, is_state=True)]
    layers = {f"l{g}": planes_from_tensor(f"l{g}", g, k.clone(), TensorLayout.KV_SECOND) for g in range(4)}
    return KVLayout.build(groups, layers, chunk_size=16, saved=saved_indices(groups, **rules))


def test_state_groups_are_skipped_by_default():
    layout = small_layout()
    assert [tg.group for tg in layout.transfer_groups] == [0, 1]
    assert {p.group for p in layout.skipped_planes} == {2, 3}
    assert layout.multi_group
    assert [tg.rows_per_chunk for tg in layout.transfer_groups] == [16, 8]
    assert layout.summary()["skipped_groups"] == [2, 3]


def test_save_and_skip_lists_match_index_or_spec_name():
    assert [tg.group for tg in small_layout(save_groups=("MambaStateSpec", "3")).transfer_groups] == [0, 1, 2, 3]
    assert [tg.group for tg in small_layout(skip_groups=("FullAttentionSpec", "1")).transfer_groups] == []
    assert [tg.group for tg in small_layout(state_markers=("Full",)).transfer_groups] == [1, 2]


def test_a_group_in_both_lists_is_refused_not_skipped():
    with pytest.raises(LayoutError) as caught:
        small_layout(save_groups=("2",), skip_groups=("MambaStateSpec",))
    assert str(caught.value) == ("group 2 (MambaStateSpec) is in both platforms.save_groups and "
                                 "platforms.skip_groups: name it in one")


@pytest.mark.parametrize(("rules", "key", "name"), [({"skip_groups": ("9",)}, "skip_groups", "9"),
                                                    ({"save_groups": ("0", "MambaSpec")}, "save_groups", "MambaSpec")])
def test_a_group_list_entry_naming_no_group_is_refused(rules, key, name):
    with pytest.raises(LayoutError) as caught:
        small_layout(**rules)
    assert str(caught.value) == (f"platforms.{key}: {name!r} names no group of this model (a group index or spec "
                                 "class name; groups: group 0 (FullAttentionSpec), group 1, group 2 (MambaStateSpec), "
                                 "group 3)")


def test_layer_names_are_filled_in_and_group_lookup():
    layout = small_layout()
    assert layout.group(1).layer_names == ("l1",)
    with pytest.raises(LayoutError, match=r"group 9 does not exist \(groups \[0, 1, 2, 3\]\)"):
        layout.group(9)


def test_chunk_slots_of_a_transfer_group():
    layout = small_layout()
    window = layout.transfer_groups[1]
    ids = ([1, 2, 3, 4], [0, 0, 5, 3], [], [])
    assert layout.chunk_slots(window, ids, 0, 16).tolist() == chunk_slots(layout.group(1), ids[1], 0, 16, 16).tolist()
    assert layout.chunk_slots(window, ids, 0, 16).tolist() == [20, 21, 22, 23, 12, 13, 14, 15]
    with pytest.raises(LayoutError, match="group 1: no block ids given"):
        layout.chunk_slots(window, ([1],), 0, 16)


def test_single_group_layout_is_not_multi_group():
    layout = small_layout(skip_groups=("1",))
    assert not layout.multi_group and layout.launches_per_chunk == 1


def plane_pair():
    t = torch.zeros(4, 2, 4, 8, dtype=torch.float16)
    return planes_from_tensor("l", 0, t, TensorLayout.KV_SECOND)


@pytest.mark.parametrize(
    ("groups", "layers", "kwargs", "message"),
    [
        ([KVGroup(0, 4)], {"l": plane_pair()}, {"mode": "fused"}, "mode must be one of bundled, exploded"),
        ([KVGroup(0, 4)], {"l": [p.__class__(**{**p.__dict__, "group": 3}) for p in plane_pair()]}, {},
         r"layer 'l' plane 'k': group 3 does not exist \(groups \[0\]\)"),
        ([KVGroup(0, 4), KVGroup(1, 6)], {"l": plane_pair()}, {},
         r"group 0: block of 4 tokens does not divide the largest block \(6 tokens\)"),
        ([KVGroup(0, 4, tokens_per_row=3)], {"l": plane_pair()}, {}, "tokens_per_row 3 does not divide chunk_size 16"),
        ([KVGroup(0, 4, tokens_per_row=4, sliding_window=6)], {"l": plane_pair()}, {},
         "tokens_per_row 4 does not divide sliding_window 6"),
        ([KVGroup(0, 4)], {"l": plane_pair()}, {"num_blocks": [5]},
         r"layer 'l' plane 'k': 16 slots \(4 blocks x 4 rows\) cannot hold group 0's 5 blocks x 4 rows"),
        ([KVGroup(0, 4)], {"l": plane_pair() + plane_pair()[:1]}, {}, "plane name appears twice"),
        ([KVGroup(0, 0)], {"l": plane_pair()}, {}, "block_size must be positive"),
        ([KVGroup(0, 4), KVGroup(0, 4)], {"l": plane_pair()}, {}, "index 0 appears twice"),
        ([KVGroup(0, 4)], {"l": plane_pair()}, {"chunk_size": 0}, "chunk_size must be positive"),
    ],
)
def test_invalid_layouts_name_the_culprit(groups, layers, kwargs, message):
    kwargs = {"chunk_size": 16, **kwargs}
    with pytest.raises(LayoutError, match=message):
        KVLayout.build(groups, layers, **kwargs)


def test_overlapping_planes_of_one_layer_are_rejected():
    k, v = plane_pair()
    alias = k.__class__(**{**v.__dict__, "name": "k2", "offset": k.offset + 2})
    with pytest.raises(LayoutError, match="layer 'l': planes 'k' and 'k2' overlap in memory"):
        KVLayout.build([KVGroup(0, 4)], {"l": [k, v, alias]}, 16)


def test_a_plane_overlapping_itself_is_rejected():
    k, _ = plane_pair()
    geometry = k.geometry.__class__(**{**k.geometry.__dict__, "row_stride": 2})
    bad = k.__class__(**{**k.__dict__, "geometry": geometry})
    with pytest.raises(LayoutError, match="plane 'k': rows overlap themselves"):
        KVLayout.build([KVGroup(0, 4)], {"l": [bad]}, 16)


def test_duplicate_layers_are_rejected():
    k, v = plane_pair()
    with pytest.raises(LayoutError, match="layer 'l' appears twice"):
        KVLayout.build([KVGroup(0, 4)], [LayerEntry("l", (k,)), LayerEntry("l", (v,))], 16)


def test_block_sizes_are_compared_in_tokens():
    """A compress-4 group with 4-row blocks (16 tokens) fits beside 16-token plain blocks."""
    groups = [KVGroup(0, 16), KVGroup(1, 4, tokens_per_row=4), KVGroup(2, 2, tokens_per_row=4)]
    layers = {f"l{g.index}": planes_from_tensor(f"l{g.index}", g.index, torch.zeros(4, 16, 8), TensorLayout.MLA)
              for g in groups}
    layout = KVLayout.build(groups, layers, 16)
    assert [tg.rows_per_chunk for tg in layout.transfer_groups] == [16, 4, 4]
