"""``materialize``: the one fixture builder that turns a layout file into real tensors and a KVLayout over them.

Tests, ``selftest`` and ``bench`` all build their KV caches here, so every one of them exercises the same
padded, shared-buffer, mixed-dtype layouts. A tool: nothing that runs inside vLLM imports it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from lmcache_platforms.layout.groups import saved_indices
from lmcache_platforms.layout.kv_layout import KVLayout, LayerEntry
from lmcache_platforms.layout.spec import LayoutSpec, PlaneSpec
from lmcache_platforms.layout.tensors import planes_from_dims

ALIGN = 256


def _padded_strides(plane: PlaneSpec, padding_bytes: int) -> tuple[tuple[int, ...], int]:
    """(element strides, element count) of a plane tensor with ``padding_bytes`` after every block."""
    pad = padding_bytes // plane.torch_dtype.itemsize
    nb = plane.dims.index("nb")
    strides = [0] * len(plane.shape)
    step = 1
    for d in range(len(plane.shape) - 1, -1, -1):
        if d == nb:
            step += pad
        strides[d] = step
        step *= plane.shape[d]
    return tuple(strides), step


def materialize_tensors(
    spec: LayoutSpec, device: str | torch.device = "cpu", seed: int = 0
) -> dict[str, list[torch.Tensor]]:
    """Real tensors for every plane spec, by layer, filled with seeded random bytes.

    The bytes are random (as floats they may be NaN), so compare contents as bytes. With
    ``shared_buffer`` every tensor is a strided view into one uint8 allocation; ``block_padding_bytes``
    leaves (random) unused bytes after every block. ``device="meta"`` gives geometry without memory.
    """
    layouts = [(layer.name, plane, *_padded_strides(plane, spec.block_padding_bytes))
               for layer in spec.layers for plane in layer.planes]
    sizes = [count * plane.torch_dtype.itemsize for _, plane, _, count in layouts]
    starts = []
    total = 0
    for size in sizes:
        starts.append(total)
        total += math.ceil(size / ALIGN) * ALIGN
    generator = torch.Generator().manual_seed(seed)

    def random_bytes(n: int) -> torch.Tensor:
        if torch.device(device).type == "meta":
            return torch.empty(n, dtype=torch.uint8, device=device)
        # Drawn as whole 64-bit words: uniform bytes at ~5x the speed of drawing them one by one (the bench-sized
        # layouts fill hundreds of MB).
        words = torch.empty((n + 7) // 8, dtype=torch.int64).random_(-(2**63), 2**63 - 1, generator=generator)
        return words.view(torch.uint8)[:n].to(device)

    shared = random_bytes(total) if spec.shared_buffer else None
    out: dict[str, list[torch.Tensor]] = {layer.name: [] for layer in spec.layers}
    for (layer, plane, strides, _), size, start in zip(layouts, sizes, starts, strict=True):
        raw = shared[start : start + size] if shared is not None else random_bytes(size)
        typed = raw.view(plane.torch_dtype)
        out[layer].append(typed.as_strided(plane.shape, strides, typed.storage_offset()))
    return out


def materialize(
    spec: LayoutSpec,
    mode: str = "bundled",
    device: str | torch.device = "cpu",
    seed: int = 0,
    state_markers: Sequence[str] = ("State",),
    save_groups: Sequence[str] = (),
    skip_groups: Sequence[str] = (),
    rows: str = "tokens",
) -> KVLayout:
    """A KVLayout whose planes have real (seeded random) storage on ``device``; see ``materialize_tensors``.
    ``rows``: token or block rows (``KVLayout.build``)."""
    return layout_over(spec, materialize_tensors(spec, device, seed), mode, state_markers, save_groups, skip_groups,
                       rows)


def layout_over(
    spec: LayoutSpec,
    tensors: Mapping[str, Sequence[torch.Tensor]],
    mode: str = "bundled",
    state_markers: Sequence[str] = ("State",),
    save_groups: Sequence[str] = (),
    skip_groups: Sequence[str] = (),
    rows: str = "tokens",
) -> KVLayout:
    """The KVLayout of ``spec`` over given tensors (``materialize_tensors``), so two plans can share them."""
    entries = []
    for layer in spec.layers:
        planes = []
        for i, (plane, tensor) in enumerate(zip(layer.planes, tensors[layer.name], strict=True)):
            name = plane.name or (str(i) if len(layer.planes) > 1 else "")
            planes += planes_from_dims(layer.name, plane.group, tensor, plane.dims, name)
        entries.append(LayerEntry(layer.name, tuple(planes)))
    saved = saved_indices(spec.groups, state_markers, save_groups, skip_groups)
    return KVLayout.build(spec.groups, entries, spec.chunk_size, mode, saved, num_blocks=spec.num_blocks, rows=rows)


def plan(
    spec: LayoutSpec,
    mode: str = "bundled",
    state_markers: Sequence[str] = ("State",),
    save_groups: Sequence[str] = (),
    skip_groups: Sequence[str] = (),
    rows: str = "tokens",
) -> KVLayout:
    """The layout's transfer plan without allocating memory (planes on the meta device)."""
    return materialize(spec, mode, device="meta", state_markers=state_markers, save_groups=save_groups,
                       skip_groups=skip_groups, rows=rows)
