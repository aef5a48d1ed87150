"""Layout files: shipped examples, JSON round trips, clear errors for malformed files, materialize()."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from hypothesis import given, settings

from lmcache_platforms.layout import LayoutError
from lmcache_platforms.layout.files import example_names, example_path, load_layout_spec, save_layout_spec
from lmcache_platforms.layout.spec import LayoutSpec
from lmcache_platforms.layout.tensors import TensorLayout, planes_from_dims, planes_from_tensor
from lmcache_platforms.tools.fixtures import materialize, materialize_tensors, plan
from tests.layout.strategies import layout_specs

BENCH = ("deepseek-v4", "llama8b")
SMALL = ("ascend-310p-nz", "deepseek-v4-small", "gemma3", "llama", "mla-int8", "qwen3-next", "vllm-cpu",
         "vllm-cpu-fp8")


def test_shipped_examples():
    assert example_names() == sorted(BENCH + SMALL)


@pytest.mark.parametrize("name", BENCH + SMALL)
def test_examples_round_trip_and_plan(name, tmp_path):
    spec = load_layout_spec(name)
    assert load_layout_spec(example_path(name)) == spec
    save_layout_spec(spec, tmp_path / "copy.json")
    assert load_layout_spec(tmp_path / "copy.json") == spec
    for mode in ("bundled", "exploded"):
        layout = plan(spec, mode)
        assert layout.chunk_bytes > 0
        assert all(p.storage.device.type == "meta" for tg in layout.transfer_groups for p in tg.planes)


def test_bench_layouts_match_the_kernels_issue():
    llama = load_layout_spec("llama8b")
    assert (len(llama.layers), llama.chunk_size, llama.num_tokens) == (32, 256, 2048)
    assert llama.layers[0].planes[0].shape[-2:] == (8, 128) and llama.layers[0].planes[0].dtype == "bfloat16"
    dsv4 = load_layout_spec("deepseek-v4")
    assert dsv4.num_tokens == 2048 and dsv4.shared_buffer and dsv4.block_padding_bytes > 0
    assert {g.tokens_per_row for g in dsv4.groups} > {1} and any(g.sliding_window for g in dsv4.groups)
    assert any(g.is_state for g in dsv4.groups)
    assert len({p.dtype for layer in dsv4.layers for p in layer.planes}) >= 3


def coverage_counts(layout) -> dict[int, torch.Tensor]:
    """Per allocation, how many planes claim each byte (vectorised over the planes' geometry)."""
    counts: dict[int, torch.Tensor] = {}
    for entry in layout.layers:
        for p in entry.planes:
            g = p.geometry
            key = p.storage.data_ptr()
            counts.setdefault(key, torch.zeros(p.storage.numel(), dtype=torch.int64))
            addr = (p.offset + torch.arange(g.num_blocks)[:, None, None, None] * g.block_stride
                    + torch.arange(g.rows_per_block)[:, None, None] * g.row_stride
                    + torch.arange(g.segments)[:, None] * g.segment_stride + torch.arange(g.segment_bytes))
            counts[key].index_add_(0, addr.reshape(-1), torch.ones(addr.numel(), dtype=torch.int64))
    return counts


@pytest.mark.parametrize("name", SMALL)
def test_materialized_examples_cover_their_tensors_exactly(name):
    spec = load_layout_spec(name)
    tensors = materialize_tensors(spec, seed=3)
    layout = materialize(spec, seed=3)
    assert [[(tuple(t.shape), str(t.dtype)) for t in ts] for ts in tensors.values()] == [
        [(p.shape, f"torch.{p.dtype}") for p in layer.planes] for layer in spec.layers]
    counts = coverage_counts(layout)
    assert len(counts) == (1 if spec.shared_buffer else sum(len(layer.planes) for layer in spec.layers))
    claimed = sum(int(c.sum()) for c in counts.values())
    natural = sum(t.numel() * t.element_size() for ts in tensors.values() for t in ts)
    assert all(int(c.max()) == 1 for c in counts.values())
    assert claimed == natural
    total = sum(c.numel() for c in counts.values())
    assert total >= claimed + (1 if spec.block_padding_bytes else 0)


def test_materialize_is_seeded_and_honours_padding():
    spec = load_layout_spec("deepseek-v4-small")
    a, b, c = (materialize(spec, seed=s) for s in (1, 1, 2))
    first = [p.rows_view().clone() for tg in a.transfer_groups for p in tg.planes]
    assert all(torch.equal(x, p.rows_view()) for x, p in zip(first, [p for tg in b.transfer_groups for p in tg.planes],
                                                             strict=True))
    assert not torch.equal(first[0], c.transfer_groups[0].planes[0].rows_view())
    swa = a.transfer_groups[0].planes[0]
    assert swa.geometry.block_stride == 16 * 584 + spec.block_padding_bytes
    assert len({p.storage.data_ptr() for tg in a.transfer_groups for p in tg.planes}) == 1
    assert [tg.group for tg in a.transfer_groups] == [0, 1, 2]
    assert [tg.group for tg in materialize(spec, save_groups=("3",)).transfer_groups] == [0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(layout_specs())
def test_random_specs_round_trip_through_json(spec):
    assert LayoutSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


GEMMA = json.loads(example_path("gemma3").read_text())


def mutate(path: str, value):
    data = copy.deepcopy(GEMMA)
    keys = path.split(".")
    target = data
    for key in keys[:-1]:
        target = target[int(key)] if key.isdigit() else target[key]
    last = int(keys[-1]) if keys[-1].isdigit() else keys[-1]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return data


MALFORMED = [
    (mutate("groups", KeyError), "layout: missing key 'groups'"),
    (mutate("foo", 1), "layout: unknown key 'foo'"),
    (mutate("layers.0.planes.0.dtype", "bfloat17"), "layers\\[0\\].planes\\[0\\].dtype: unknown dtype 'bfloat17'"),
    (mutate("layers.0.planes.0.dims", ["nb", "kv", "x", "h", "d"]), "exactly one 'nb' and one 'bs'"),
    (mutate("layers.0.planes.0.shape", [24, 3, 16, 2, 64]), "the 'kv' dim must have size 2, got 3"),
    (mutate("layers.0.planes.0.group", 5), "layers\\[0\\].planes\\[0\\].group: group 5 does not exist"),
    (mutate("layers.0.planes.0.shape", [24, 2, 16, 2]),
     r"5 dims \['nb', 'kv', 'bs', 'h', 'd'\] for shape \[24, 2, 16, 2\]"),
    (mutate("num_blocks", [24]), "num_blocks: 1 entries for 2 groups"),
    (mutate("num_blocks", 12), "group 0 \\(FullAttentionSpec\\) needs 19 blocks for 300 tokens"),
    (mutate("groups.0.block_size", "16"), "groups\\[0\\].block_size: expected an integer >= 1, got '16'"),
    (mutate("groups.1.tokens_per_row", 3), "tokens_per_row 3 does not divide chunk_size 64"),
    (mutate("groups.1.block_size", 24), "block of 16 tokens does not divide the largest block \\(24 tokens\\)"),
    (mutate("block_padding_bytes", 3), "block_padding_bytes 3 is not a multiple of the bfloat16 element size 2"),
    (mutate("layers.0.planes.0.shape", [20, 2, 16, 2, 64]), "320 slots cannot hold group 1"),
    (mutate("layers.1.name", "model.layers.0.self_attn"), "layer name 'model.layers.0.self_attn' appears twice"),
    (mutate("groups.1.sliding_window", 0), "groups\\[1\\].sliding_window: expected an integer >= 1"),
    (mutate("groups.1.state", "yes"), "groups\\[1\\].state: expected true or false"),
    (mutate("layers", []), "layers: expected a non-empty list"),
    ([GEMMA], "layout: expected an object, got list"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED)
def test_malformed_files_fail_with_the_path_and_value(data, message, tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(LayoutError, match=message) as info:
        load_layout_spec(path)
    assert str(info.value).startswith(f"{path}: ")
    assert "\n" not in str(info.value)


def test_unreadable_and_unknown_files(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(LayoutError, match=r"bad\.json: not valid JSON"):
        load_layout_spec(bad)
    with pytest.raises(LayoutError, match="nonexistent: no such layout file or example \\(examples: ascend-310p-nz"):
        load_layout_spec("nonexistent")


@settings(max_examples=40, deadline=None)
@given(layout_specs())
def test_random_materialized_layouts_cover_their_tensors_exactly(spec):
    tensors = materialize_tensors(spec, seed=5)
    counts = coverage_counts(materialize(spec, seed=5))
    assert all(int(c.max()) == 1 for c in counts.values())
    assert sum(int(c.sum()) for c in counts.values()) == sum(
        t.numel() * t.element_size() for ts in tensors.values() for t in ts)


def test_vllm_cpu_example_matches_the_vllm_cpu_hint():
    """The file's ("nb", "h", "kv", "bs", "d") pages are what vLLM's declared [nb, h, bs, 2d] tensor holds."""
    spec = load_layout_spec("vllm-cpu")
    page = materialize_tensors(spec)[spec.layers[0].name][0]
    nb, h, _, bs, d = page.shape
    declared = page.view(nb, h, bs, 2 * d)
    assert planes_from_tensor("l", 0, declared, TensorLayout.VLLM_CPU) == planes_from_dims(
        "l", 0, page, spec.layers[0].planes[0].dims)
