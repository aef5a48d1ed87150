"""Planes from real KV tensors: every supported tensor kind becomes byte geometry via named dimensions.

A tensor's dimensions are named (``nb`` blocks, ``bs`` rows of a block, ``kv`` a K/V split, anything else
part of a row) and its own strides give the geometry, so padded pools and strided views into a shared
buffer need no special case. A row must be ``segments`` equal pieces one stride apart: the innermost
contiguous row dims form a segment, the others must collapse into one stride. When they cannot (a K stored
transposed per head), the outermost row dim is split into one plane per index.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any, cast

import torch

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.plane import Plane, PlaneGeometry

Dims = tuple[str, ...]


class TensorLayout(enum.Enum):
    """Memory layouts whose shape alone is ambiguous; each maps a tensor to named dims."""

    NHD = "nhd"  # [nb, bs, *row] (also MLA [nb, bs, d])
    HND = "hnd"  # [nb, h, bs, d]
    KV_FIRST = "kv_first"  # [2, nb, bs, *row]
    KV_SECOND = "kv_second"  # [nb, 2, bs, *row]
    MLA = "mla"  # [nb, bs, d], one plane
    NZ = "nz"  # Ascend 310P FRACTAL_NZ [nb, h*d/16, bs, 16]
    VLLM_CPU = "vllm_cpu"  # declared [nb, h, bs, 2d], stored [K bs x d][V bs x d] per (block, head)
    VLLM_CPU_K_TRANSPOSED = "vllm_cpu_k_transposed"  # as VLLM_CPU with K stored [d x bs]
    # As VLLM_CPU, but K and V of a (block, head) are tiled inside their halves of the page (vLLM's AMX ISA):
    # rows are described as VLLM_CPU's so that the bytes add up, and are moved only as whole block pages.
    VLLM_CPU_PAGES = "vllm_cpu_pages"


Hint = TensorLayout | Sequence[str] | None


def _storage_of(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(tensor.untyped_storage())


def _row_segments(row: list[tuple[int, int]], item: int) -> tuple[int, int, int] | None:
    """(segments, segment_bytes, segment_stride) of row dims [(size, stride_elems)], or None if not one stride."""
    row = [(size, stride) for size, stride in row if size != 1]
    seg_elems = 1
    while row and row[-1][1] == seg_elems:
        seg_elems *= row.pop()[0]
    count, stride = row.pop() if row else (1, seg_elems)
    while row:
        size, outer = row.pop()
        if outer != count * stride:
            return None
        count *= size
    return count, seg_elems * item, stride * item


def _planes_of_view(layer: str, group: int, name: str, view: torch.Tensor, dims: Dims) -> list[Plane]:
    item = view.element_size()
    for dim, (size, stride) in enumerate(zip(view.shape, view.stride(), strict=True)):
        if size > 1 and stride <= 0:
            raise LayoutError(f"layer {layer!r} plane {name!r}: dim {dims[dim]!r} has stride {stride}")
    nb, bs = dims.index("nb"), dims.index("bs")
    row_dims = [d for d in range(view.dim()) if d not in (nb, bs)]
    seg = _row_segments([(view.shape[d], view.stride(d)) for d in row_dims], item)
    if seg is None:
        split = next(d for d in row_dims if view.shape[d] > 1)
        planes: list[Plane] = []
        for i in range(view.shape[split]):
            sub = view.narrow(split, i, 1)
            planes += _planes_of_view(layer, group, f"{name}.{dims[split]}{i}", sub, dims)
        return planes
    segments, segment_bytes, segment_stride = seg
    geometry = PlaneGeometry(
        num_blocks=view.shape[nb],
        block_stride=view.stride(nb) * item,
        rows_per_block=view.shape[bs],
        row_stride=view.stride(bs) * item,
        segments=segments,
        segment_bytes=segment_bytes,
        segment_stride=segment_stride,
    )
    storage = _storage_of(view)
    return [Plane(layer, name, group, view.dtype, geometry, int(view.storage_offset()) * item, storage)]


def _check_dims(layer: str, tensor: torch.Tensor, dims: Dims) -> None:
    if len(dims) != tensor.dim():
        raise LayoutError(f"layer {layer!r}: dims {list(dims)} do not match shape {list(tensor.shape)}")
    for special in ("nb", "bs"):
        if dims.count(special) != 1:
            raise LayoutError(f"layer {layer!r}: dims {list(dims)} need exactly one {special!r}")
    if dims.count("kv") > 1 or ("kv" in dims and tensor.shape[dims.index("kv")] != 2):
        raise LayoutError(f"layer {layer!r}: a 'kv' dim must appear once with size 2, dims {list(dims)} "
                          f"shape {list(tensor.shape)}")
    if len(set(dims)) != len(dims):
        raise LayoutError(f"layer {layer!r}: repeated dim names in {list(dims)}")
    if tensor.numel() == 0:
        raise LayoutError(f"layer {layer!r}: empty tensor of shape {list(tensor.shape)}")


def planes_from_dims(layer: str, group: int, tensor: torch.Tensor, dims: Sequence[str], name: str = "") -> list[Plane]:
    """Planes of ``tensor`` whose dims are named ``dims`` (in the tensor's own dim order)."""
    dims = tuple(dims)
    _check_dims(layer, tensor, dims)
    if "kv" not in dims:
        return _planes_of_view(layer, group, name or "kv", tensor, dims)
    kv = dims.index("kv")
    rest = dims[:kv] + dims[kv + 1 :]
    prefix = f"{name}." if name else ""
    return [
        plane
        for i, part in enumerate("kv")
        for plane in _planes_of_view(layer, group, prefix + part, tensor.select(kv, i), rest)
    ]


def _vllm_cpu_views(layer: str, tensor: torch.Tensor, k_transposed: bool) -> list[tuple[str, torch.Tensor]]:
    if tensor.dim() != 4 or tensor.shape[3] % 2:
        raise LayoutError(f"layer {layer!r}: vLLM CPU cache must be [nb, h, bs, 2*d], got {list(tensor.shape)}")
    nb, heads, bs, two_d = tensor.shape
    d = two_d // 2
    s_nb, s_h, s_bs, s_e = tensor.stride()
    if s_e != 1 or s_bs != two_d:
        raise LayoutError(f"layer {layer!r}: vLLM CPU cache needs contiguous (block, head) pages, "
                          f"strides {list(tensor.stride())}")
    base = tensor.storage_offset()
    k_strides = (s_nb, s_h, 1, bs) if k_transposed else (s_nb, s_h, d, 1)
    k = tensor.as_strided((nb, heads, bs, d), k_strides, base)
    v = tensor.as_strided((nb, heads, bs, d), (s_nb, s_h, d, 1), base + bs * d)
    return [("k", k), ("v", v)]


_VLLM_CPU_HINTS = (TensorLayout.VLLM_CPU, TensorLayout.VLLM_CPU_K_TRANSPOSED, TensorLayout.VLLM_CPU_PAGES)

_HINT_DIMS: dict[TensorLayout, Dims] = {
    TensorLayout.HND: ("nb", "h", "bs", "d"),
    TensorLayout.MLA: ("nb", "bs", "d"),
    TensorLayout.NZ: ("nb", "c", "bs", "e"),
}


def _dims_for(layer: str, tensor: torch.Tensor, hint: Hint, block_size: int | None) -> Dims:
    rank = tensor.dim()
    row = tuple(f"r{i}" for i in range(max(0, rank - 3)))
    if hint is None:
        hint = _infer(layer, tensor, block_size)
    if not isinstance(hint, TensorLayout):
        return tuple(hint)
    if hint in _HINT_DIMS:
        return _HINT_DIMS[hint]
    if hint is TensorLayout.NHD:
        return ("nb", "bs", *tuple(f"r{i}" for i in range(rank - 2)))
    if hint is TensorLayout.KV_FIRST:
        return ("kv", "nb", "bs", *row)
    if hint is TensorLayout.KV_SECOND:
        return ("nb", "kv", "bs", *row)
    raise LayoutError(f"layer {layer!r}: hint {hint} does not map to dims")


def _infer(layer: str, tensor: torch.Tensor, block_size: int | None) -> TensorLayout:
    shape = list(tensor.shape)
    if tensor.dim() in (2, 3):
        return TensorLayout.NHD
    if tensor.dim() == 5 and (shape[0] == 2) != (shape[1] == 2):
        kv = TensorLayout.KV_FIRST if shape[0] == 2 else TensorLayout.KV_SECOND
        if block_size is None or shape[2] == block_size:
            return kv
    if tensor.dim() == 4 and block_size is not None and (shape[1] == block_size) != (shape[2] == block_size):
        return TensorLayout.NHD if shape[1] == block_size else TensorLayout.HND
    raise LayoutError(f"layer {layer!r}: shape {shape} is ambiguous, pass a hint (TensorLayout or dims)")


def planes_from_tensor(
    layer: str,
    group: int | Sequence[int],
    value: torch.Tensor | Sequence[torch.Tensor],
    hint: Hint | Sequence[Hint] = None,
    block_size: int | None = None,
    names: Sequence[str] | None = None,
) -> list[Plane]:
    """Planes of one layer's KV cache ``value``: a tensor, or a tuple/list of them (mixed dtypes allowed).

    ``group`` is the scheduler group of every plane, or one per tuple item; ``hint`` likewise (a
    TensorLayout or explicit dims). Without a hint the shape must be unambiguous, which ``block_size``
    (rows per block) helps decide. Tuple items are named by ``names`` or their position.
    """
    if isinstance(value, torch.Tensor):
        items: list[torch.Tensor] = [value]
        item_names = list(names or [""])
    else:
        items = list(value)
        item_names = list(names) if names is not None else [str(i) for i in range(len(items))]
    if len(item_names) != len(items):
        raise LayoutError(f"layer {layer!r}: {len(item_names)} names for {len(items)} tensors")
    groups = [group] * len(items) if isinstance(group, int) else list(group)
    is_list_hint = isinstance(hint, (list, tuple)) and hint and not isinstance(hint[0], str)
    hints: list[Any] = list(cast(Sequence[Any], hint)) if is_list_hint else [hint] * len(items)
    if len(groups) != len(items) or len(hints) != len(items):
        raise LayoutError(f"layer {layer!r}: {len(items)} tensors but {len(groups)} groups / {len(hints)} hints")
    planes: list[Plane] = []
    for tensor, name, grp, item_hint in zip(items, item_names, groups, hints, strict=True):
        if item_hint in _VLLM_CPU_HINTS:
            transposed = item_hint is TensorLayout.VLLM_CPU_K_TRANSPOSED
            prefix = f"{name}." if name else ""
            for part, view in _vllm_cpu_views(layer, tensor, transposed):
                found = _planes_of_view(layer, grp, prefix + part, view, ("nb", "h", "bs", "d"))
                if item_hint is TensorLayout.VLLM_CPU_PAGES:
                    found = [dataclasses.replace(p, pages_only=True) for p in found]
                planes += found
            continue
        dims = _dims_for(layer, tensor, item_hint, block_size)
        planes += planes_from_dims(layer, grp, tensor, dims, name)
    return planes
