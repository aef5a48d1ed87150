"""Every supported tensor kind maps to planes whose byte addresses match the tensor's own indexing."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.layout import LayoutError
from lmcache_platforms.layout.plane import Plane
from lmcache_platforms.layout.tensors import TensorLayout, planes_from_dims, planes_from_tensor
from tests.layout.addresses import payload_addresses
from tests.layout.strategies import DIM_TEMPLATES, DTYPES

GEN = torch.Generator().manual_seed(7)


def rand(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    item = torch.empty(0, dtype=dtype).element_size()
    raw = torch.randint(0, 256, (math.prod(shape) * item,), dtype=torch.uint8, generator=GEN)
    return raw.view(dtype).reshape(shape)


def as_bytes(t: torch.Tensor) -> list[int]:
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


def assert_rows(planes: list[Plane], expected: dict[str, Callable[[int, int], torch.Tensor]]) -> None:
    assert sorted(p.name for p in planes) == sorted(expected)
    for plane in planes:
        flat, g = plane.storage.tolist(), plane.geometry
        for slot in range(g.num_slots):
            got = [flat[a] for a in payload_addresses(g, [slot], plane.offset)]
            assert got == as_bytes(expected[plane.name](*divmod(slot, g.rows_per_block))), (plane.name, slot)


def plane_addresses(plane: Plane) -> list[int]:
    g = plane.geometry
    return payload_addresses(g, range(g.num_slots), plane.storage.data_ptr() + plane.offset)


def tensor_addresses(t: torch.Tensor) -> list[int]:
    item = t.element_size()
    elems = torch.full(t.shape, t.storage_offset(), dtype=torch.int64)
    for d, (size, stride) in enumerate(zip(t.shape, t.stride(), strict=True)):
        shape = [1] * t.dim()
        shape[d] = size
        elems = elems + (torch.arange(size) * stride).reshape(shape)
    base = t.untyped_storage().data_ptr()
    return [base + e * item + i for e in elems.reshape(-1).tolist() for i in range(item)]


def assert_partition(planes: list[Plane], tensors: list[torch.Tensor]) -> None:
    """The planes' payload bytes are disjoint and are exactly the tensors' bytes (absolute addresses)."""
    got = [a for p in planes for a in plane_addresses(p)]
    assert len(got) == len(set(got))
    assert sorted(got) == sorted(a for t in tensors for a in tensor_addresses(t))


NB, BS, H, D = 3, 4, 2, 8


def test_nhd_and_inferred_nhd():
    t = rand((NB, BS, H, D), torch.bfloat16)
    for planes in (planes_from_tensor("l", 0, t, TensorLayout.NHD), planes_from_tensor("l", 0, t, block_size=BS)):
        assert_rows(planes, {"kv": lambda b, r: t[b, r]})
        assert planes[0].geometry.segments == 1
        assert_partition(planes, [t])


def test_hnd_rows_are_one_segment_per_head():
    t = rand((NB, H, BS, D), torch.float16)
    planes = planes_from_tensor("l", 0, t, TensorLayout.HND)
    assert_rows(planes, {"kv": lambda b, r: t[b, :, r]})
    assert (planes[0].geometry.segments, planes[0].geometry.segment_bytes) == (H, D * 2)
    assert planes_from_tensor("l", 0, t, block_size=BS) == planes
    assert_partition(planes, [t])


@pytest.mark.parametrize("hint", [TensorLayout.KV_FIRST, None])
def test_kv_first(hint):
    t = rand((2, NB, BS, H, D), torch.bfloat16)
    planes = planes_from_tensor("l", 0, t, hint)
    assert_rows(planes, {"k": lambda b, r: t[0, b, r], "v": lambda b, r: t[1, b, r]})
    assert_partition(planes, [t])


@pytest.mark.parametrize("hint", [TensorLayout.KV_SECOND, None])
def test_kv_second(hint):
    t = rand((NB, 2, BS, H, D), torch.float32)
    planes = planes_from_tensor("l", 0, t, hint)
    assert_rows(planes, {"k": lambda b, r: t[b, 0, r], "v": lambda b, r: t[b, 1, r]})
    assert_partition(planes, [t])


def test_mla_single_plane():
    t = rand((NB, BS, 24), torch.bfloat16)
    planes = planes_from_tensor("l", 0, t, TensorLayout.MLA)
    assert_rows(planes, {"kv": lambda b, r: t[b, r]})


def test_ascend_310p_fractal_nz():
    t = rand((NB, H * 32 // 16, BS, 16), torch.float16)
    k, v = t, rand(t.shape, torch.float16)
    planes = planes_from_tensor("l", 0, (k, v), TensorLayout.NZ, names=("k", "v"))
    assert_rows(planes, {"k": lambda b, r: k[b, :, r, :], "v": lambda b, r: v[b, :, r, :]})
    g = planes[0].geometry
    assert (g.segments, g.segment_bytes, g.segment_stride) == (t.shape[1], 32, BS * 32)
    assert_partition(planes, [k, v])


def test_vllm_cpu_pages():
    t = rand((NB, H, BS, 2 * D), torch.bfloat16)
    pages = t.view(NB, H, 2, BS, D)
    planes = planes_from_tensor("l", 0, t, TensorLayout.VLLM_CPU)
    assert_rows(planes, {"k": lambda b, r: pages[b, :, 0, r], "v": lambda b, r: pages[b, :, 1, r]})
    assert_partition(planes, [t])


def test_vllm_cpu_pages_with_transposed_k_split_per_head():
    t = rand((NB, H, BS, 2 * D), torch.bfloat16)
    pages = t.view(NB, H, 2, BS, D)
    k_t = t.view(NB, H, 2, BS * D)[:, :, 0].reshape(NB, H, D, BS)
    planes = planes_from_tensor("l", 0, t, TensorLayout.VLLM_CPU_K_TRANSPOSED)
    expected = {f"k.h{h}": (lambda b, r, h=h: k_t[b, h, :, r]) for h in range(H)}
    assert_rows(planes, expected | {"v": lambda b, r: pages[b, :, 1, r]})
    k0 = planes[0].geometry
    assert (k0.segments, k0.segment_bytes, k0.segment_stride) == (D, 2, BS * 2)
    assert_partition(planes, [t])


def test_tuple_with_mixed_dtypes_and_block_sizes():
    k, v = rand((NB, BS, H, D), torch.bfloat16), rand((NB, BS, H, D), torch.bfloat16)
    dsa_k = rand((2 * NB, BS // 2, 132), torch.int8)
    scale = rand((NB, BS, 1), torch.float16)
    planes = planes_from_tensor("l", [0, 0, 1, 1], (k, v, dsa_k, scale), TensorLayout.NHD,
                                names=("k", "v", "dsa_k", "dsa_k_scale"))
    assert_rows(planes, {"k": lambda b, r: k[b, r], "v": lambda b, r: v[b, r],
                         "dsa_k": lambda b, r: dsa_k[b, r], "dsa_k_scale": lambda b, r: scale[b, r]})
    assert [p.group for p in planes] == [0, 0, 1, 1]
    assert [p.row_bytes for p in planes] == [H * D * 2, H * D * 2, 132, 2]
    assert planes[2].geometry.rows_per_block == BS // 2


def test_one_element_rows():
    t = rand((NB, BS), torch.float16)
    planes = planes_from_tensor("l", 0, t)
    assert_rows(planes, {"kv": lambda b, r: t[b, r]})
    assert planes[0].row_bytes == 2


def test_padded_pool_keeps_its_block_stride():
    natural, pad = BS * H * D, 24
    storage = rand((NB * (natural + pad),), torch.bfloat16)
    t = storage.as_strided((NB, BS, H, D), (natural + pad, H * D, D, 1))
    planes = planes_from_tensor("l", 0, t, TensorLayout.NHD)
    assert planes[0].geometry.block_stride == (natural + pad) * 2
    assert_rows(planes, {"kv": lambda b, r: t[b, r]})
    assert_partition(planes, [t])


def test_strided_views_into_one_shared_int8_buffer():
    buf = rand((4096,), torch.int8)
    first = buf[256 : 256 + NB * 2 * BS * D * 2].view(torch.bfloat16).view(NB, 2, BS, D)
    second = buf[1024 : 1024 + NB * BS * 132].view(NB, BS, 132)
    p1 = planes_from_tensor("a", 0, first, TensorLayout.KV_SECOND)
    p2 = planes_from_tensor("b", 1, second, TensorLayout.NHD)
    assert [p.offset for p in p1 + p2] == [256, 256 + BS * D * 2, 1024]
    assert len({p.storage.data_ptr() for p in p1 + p2}) == 1
    assert p1[0].storage.numel() == 4096
    assert_rows(p1, {"k": lambda b, r: first[b, 0, r], "v": lambda b, r: first[b, 1, r]})
    assert_rows(p2, {"kv": lambda b, r: second[b, r]})


def test_ambiguous_shapes_need_a_hint():
    with pytest.raises(LayoutError, match=r"layer 'x': shape \[3, 4, 4, 8\] is ambiguous"):
        planes_from_tensor("x", 0, rand((3, 4, 4, 8), torch.float16), block_size=4)
    with pytest.raises(LayoutError, match="ambiguous"):
        planes_from_tensor("x", 0, rand((3, 4, 2, 8), torch.float16))


@pytest.mark.parametrize(
    ("shape", "dims", "message"),
    [
        ((3, 4, 8), ("nb", "bs"), r"dims \['nb', 'bs'\] do not match shape \[3, 4, 8\]"),
        ((3, 4, 8), ("nb", "x", "d"), "need exactly one 'bs'"),
        ((3, 3, 4, 8), ("nb", "kv", "bs", "d"), "a 'kv' dim must appear once with size 2"),
        ((3, 4, 8, 8), ("nb", "bs", "d", "d"), "repeated dim names"),
        ((3, 0, 8), ("nb", "bs", "d"), "empty tensor"),
    ],
)
def test_bad_dims_are_rejected(shape, dims, message):
    with pytest.raises(LayoutError, match=message):
        planes_from_dims("layer0", 0, torch.zeros(shape), dims)


def test_broadcast_strides_are_rejected():
    t = torch.zeros(3, 1, 8).expand(3, 4, 8)
    with pytest.raises(LayoutError, match="layer 'l' plane 'kv': dim 'bs' has stride 0"):
        planes_from_dims("l", 0, t, ("nb", "bs", "d"))


def test_vllm_cpu_needs_contiguous_pages():
    with pytest.raises(LayoutError, match=r"must be \[nb, h, bs, 2\*d\]"):
        planes_from_tensor("l", 0, rand((3, 2, 4, 7), torch.float16), TensorLayout.VLLM_CPU)
    strided = rand((3, 2, 8, 16), torch.float16)[:, :, ::2]
    with pytest.raises(LayoutError, match="contiguous \\(block, head\\) pages"):
        planes_from_tensor("l", 0, strided, TensorLayout.VLLM_CPU)


def test_tuple_argument_counts_must_agree():
    t = rand((3, 4, 8), torch.float16)
    with pytest.raises(LayoutError, match="2 tensors but 3 groups"):
        planes_from_tensor("l", [0, 1, 2], (t, t))
    with pytest.raises(LayoutError, match="1 names for 2 tensors"):
        planes_from_tensor("l", 0, (t, t), names=("k",))


@st.composite
def permuted_tensors(draw):
    """A contiguous tensor in a template's memory order, viewed with its dims in a random logical order."""
    dims = draw(st.sampled_from(DIM_TEMPLATES))
    sizes = {"nb": draw(st.integers(1, 3)), "bs": draw(st.integers(1, 4)), "kv": 2}
    shape = tuple(sizes.get(d) or draw(st.integers(1, 4)) for d in dims)
    dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
    order = draw(st.permutations(range(len(dims))))
    t = rand(shape, dtype).permute(*order)
    return t, tuple(dims[i] for i in order)


def element_labels(t: torch.Tensor, dims: tuple[str, ...]) -> dict[int, tuple[int, int, int, int]]:
    """Byte address of each element -> (block, row, kv, row-major index over the logical row dims)."""
    row_dims = [i for i, d in enumerate(dims) if d not in ("nb", "bs", "kv")]
    labels = {}
    for idx in torch.cartesian_prod(*[torch.arange(s) for s in t.shape]).reshape(-1, t.dim()).tolist():
        addr = (t.storage_offset() + sum(i * s for i, s in zip(idx, t.stride(), strict=True))) * t.element_size()
        linear = 0
        for d in row_dims:
            linear = linear * t.shape[d] + idx[d]
        kv = idx[dims.index("kv")] if "kv" in dims else 0
        labels[addr] = (idx[dims.index("nb")], idx[dims.index("bs")], kv, linear)
    return labels


@settings(max_examples=60, deadline=None)
@given(permuted_tensors())
def test_any_dim_order_maps_rows_to_their_own_elements(case):
    t, dims = case
    planes = planes_from_dims("l", 0, t, dims)
    assert_partition(planes, [t])
    labels, item = element_labels(t, dims), t.element_size()
    for plane in planes:
        g = plane.geometry
        assert g.segment_bytes % item == 0
        kvs = set()
        for slot in range(g.num_slots):
            addrs = payload_addresses(g, [slot], plane.offset)
            elems = addrs[::item]
            assert all(addrs[k] == elems[k // item] + k % item for k in range(len(addrs)))
            owners = [labels[a] for a in elems]
            assert {o[:2] for o in owners} == {divmod(slot, g.rows_per_block)}
            kvs |= {o[2] for o in owners}
            linear = [o[3] for o in owners]
            assert linear == sorted(set(linear))
        assert len(kvs) == 1
