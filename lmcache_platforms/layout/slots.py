"""Slot and row arithmetic of one KV-cache group: which rows a token range owns and where they live.

Pure functions; block ids come as python lists or int64 tensors (vLLM gives one list per group). A row
holds ``tokens_per_row`` consecutive tokens; row ``r`` lives in block ``ids[r // block_size]`` at offset
``r % block_size`` and its slot is ``block * block_size + offset``. Block id 0 is vLLM's null block (no
storage), so its rows get slot -1, which every transfer skips.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.groups import KVGroup

BlockIds = Sequence[int] | torch.Tensor


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _as_tensor(block_ids: BlockIds) -> torch.Tensor:
    if isinstance(block_ids, torch.Tensor):
        return block_ids.to(torch.int64).reshape(-1)
    return torch.tensor(list(block_ids), dtype=torch.int64)


def rows_for_tokens(num_tokens: int, group: KVGroup) -> int:
    """Rows ``num_tokens`` tokens occupy in this group (a partly filled last row counts)."""
    if num_tokens < 0:
        raise LayoutError(f"{group.describe()}: negative token count {num_tokens}")
    return _ceil_div(num_tokens, group.tokens_per_row)


def _slots_of_rows(group: KVGroup, block_ids: BlockIds, rows: torch.Tensor) -> torch.Tensor:
    ids = _as_tensor(block_ids).to(rows.device)
    if rows.numel() == 0:
        return torch.empty(0, dtype=torch.int64, device=rows.device)
    needed = int(rows.max()) // group.block_size + 1
    if needed > ids.numel():
        raise LayoutError(
            f"{group.describe()}: row {int(rows.max())} needs {needed} blocks of {group.block_size} rows, "
            f"only {ids.numel()} block ids given"
        )
    blocks = ids[rows // group.block_size]
    if bool((blocks < 0).any()):
        raise LayoutError(f"{group.describe()}: negative block id {int(blocks.min())}")
    slots = blocks * group.block_size + rows % group.block_size
    return torch.where(blocks == 0, torch.full_like(slots, -1), slots)


def slot_mapping(group: KVGroup, block_ids: BlockIds, num_rows: int) -> torch.Tensor:
    """int64 slots of rows ``[0, num_rows)``; rows in the null block get -1."""
    device = block_ids.device if isinstance(block_ids, torch.Tensor) else "cpu"
    return _slots_of_rows(group, block_ids, torch.arange(num_rows, dtype=torch.int64, device=device))


def _check_chunk(group: KVGroup, start: int, end: int, chunk_size: int) -> None:
    if start < 0 or end <= start or end - start > chunk_size or start % chunk_size:
        raise LayoutError(
            f"{group.describe()}: [{start}, {end}) is not a chunk of {chunk_size} tokens "
            "(start a multiple of the chunk size, 1 to chunk_size tokens long)"
        )
    if chunk_size % group.tokens_per_row:
        raise LayoutError(
            f"{group.describe()}: tokens_per_row {group.tokens_per_row} does not divide chunk_size {chunk_size}"
        )


def chunk_rows(group: KVGroup, start: int, end: int, chunk_size: int) -> tuple[int, int]:
    """(first_row, num_rows): the rows chunk ``[start, end)`` stores, as the group's kind decides (all rows
    whose first token lies in the chunk, a window's tail of them, or the snapshot at its end)."""
    _check_chunk(group, start, end, chunk_size)
    return group.kind.rows(group, start, end)


def physical_rows_per_chunk(group: KVGroup, chunk_size: int, whole_chunks: bool = False) -> int:
    """Rows one chunk reserves for this group, as its kind decides; ``whole_chunks``: every chunk is saved
    whole (a window of compressed rows needs one row more where a partial chunk ends inside a row)."""
    return group.kind.rows_per_chunk(group, chunk_size, whole_chunks)


# Up to this many slots a batch is computed in plain Python: block rows give a handful per chunk, and a dozen
# small tensor operations per group cost more than the loop.
PYTHON_SLOTS = 512


def chunks_slots(group: KVGroup, block_ids: BlockIds, bounds: Sequence[tuple[int, int]],
                 chunk_size: int, whole_chunks: bool = False) -> torch.Tensor:
    """Slots of the rows each chunk ``[start, end)`` of ``bounds`` stores, in row order, -1 padded to the
    physical size (``physical_rows_per_chunk``): ``[len(bounds), physical rows]``. One pass for a whole
    batch: per chunk, the handful of small tensor operations cost more than the kernel moving a window's rows."""
    width = physical_rows_per_chunk(group, chunk_size, whole_chunks)
    spans = [chunk_rows(group, start, end, chunk_size) for start, end in bounds]
    if any(count > width for _, count in spans):
        raise LayoutError(f"{group.describe()}: a chunk of {chunk_size} tokens holds more than its {width} rows")
    on_host = not isinstance(block_ids, torch.Tensor) or block_ids.device.type == "cpu"
    if on_host and len(spans) * width <= PYTHON_SLOTS:
        return _few_slots(group, block_ids, spans, width)
    device = block_ids.device if isinstance(block_ids, torch.Tensor) else "cpu"
    firsts = torch.tensor([first for first, _ in spans], dtype=torch.int64, device=device)
    counts = torch.tensor([count for _, count in spans], dtype=torch.int64, device=device)
    offsets = torch.arange(width, dtype=torch.int64, device=device)
    used = offsets < counts[:, None]
    out = torch.full((len(spans), width), -1, dtype=torch.int64, device=device)
    out[used] = _slots_of_rows(group, block_ids, (firsts[:, None] + offsets)[used])
    return out


def _few_slots(group: KVGroup, block_ids: BlockIds, spans: Sequence[tuple[int, int]], width: int) -> torch.Tensor:
    """``chunks_slots`` for a few slots of host block ids, with ``_slots_of_rows``'s checks and messages."""
    ids = block_ids.tolist() if isinstance(block_ids, torch.Tensor) else list(block_ids)
    size = group.block_size
    rows = [range(first, first + count) for first, count in spans]
    last = max((r[-1] for r in rows if r), default=None)
    if last is not None and last // size + 1 > len(ids):
        raise LayoutError(f"{group.describe()}: row {last} needs {last // size + 1} blocks of {size} rows, "
                          f"only {len(ids)} block ids given")
    blocks = [[ids[r // size] for r in span] for span in rows]
    lowest = min((b for chunk in blocks for b in chunk), default=0)
    if lowest < 0:
        raise LayoutError(f"{group.describe()}: negative block id {lowest}")
    out = [[-1 if b == 0 else b * size + r % size for b, r in zip(chunk, span, strict=True)]
           + [-1] * (width - len(span)) for chunk, span in zip(blocks, rows, strict=True)]
    return torch.tensor(out, dtype=torch.int64).reshape(len(spans), width)


def chunk_slots(group: KVGroup, block_ids: BlockIds, start: int, end: int, chunk_size: int,
                whole_chunks: bool = False) -> torch.Tensor:
    """Slots of the rows chunk ``[start, end)`` stores, in row order, padded with -1 to the physical size."""
    return chunks_slots(group, block_ids, [(start, end)], chunk_size, whole_chunks)[0]
