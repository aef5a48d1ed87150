"""Poisoned blocks, a test switch (``platforms.poison_loads``, off by default): before a load writes a request's
blocks, every row of them in every plane the layout moves is overwritten with random finite values.

"Identical to vLLM without a connector" proves a load right only if a row the load should have written and did
not could not hold the right bytes by chance: a block vLLM hands a request may still hold the same prefix from
an earlier request. Poisoned, such a row changes the answer. Values are finite (attention kernels may read rows
they then mask, and a NaN there would poison rows that are written right too).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.plane import Plane

# One-byte values finite as fp8 e4m3fn and e5m2 (their NaN and infinity codes have every exponent bit set) and
# as int8: exponent bits kept below all-ones, either sign.
_SAFE_BYTES = torch.tensor([b for b in range(256) if (b & 0x7F) < 0x70], dtype=torch.uint8)


def _random_bytes(plane: Plane, count: int, gen: torch.Generator) -> torch.Tensor:
    """``count`` bytes of random finite values of the plane's element type."""
    dtype = plane.dtype
    if dtype.is_floating_point and dtype.itemsize > 1 and count % dtype.itemsize == 0:
        values = torch.randn(count // dtype.itemsize, generator=gen).to(dtype)
        return values.view(torch.uint8)
    return _SAFE_BYTES[torch.randint(len(_SAFE_BYTES), (count,), generator=gen)]


def poison_blocks(layout: KVLayout, block_ids: Sequence[Sequence[int]], seed: int) -> int:
    """Overwrite every row of the non-null ``block_ids`` (one list per vLLM group) in every plane the layout
    moves; returns the number of (plane, block) pages written."""
    gen = torch.Generator().manual_seed(seed)
    written = 0
    planes = [p for tg in layout.transfer_groups for p in tg.planes] + list(layout.skipped_planes)
    for plane in planes:
        if plane.group >= len(block_ids) or plane.storage is None:
            continue
        ids = sorted({int(b) for b in block_ids[plane.group] if int(b) > 0})
        if not ids:
            continue
        view = plane.rows_view()
        index = torch.tensor(ids, dtype=torch.int64, device=view.device)
        page_bytes = view[0].numel()
        noise = _random_bytes(plane, page_bytes * len(ids), gen).view(len(ids), *view.shape[1:])
        view[index] = noise.to(view.device)
        written += len(ids)
    return written
