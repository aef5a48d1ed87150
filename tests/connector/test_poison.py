"""Poisoned blocks (``platforms.poison_loads``): every row of exactly the blocks given is overwritten, in every
plane of every group the layout moves, with finite values; nothing else changes."""

from __future__ import annotations

import pytest
import torch

from lmcache_platforms.connector.poison import poison_blocks
from lmcache_platforms.layout.files import load_layout_spec
from lmcache_platforms.tools.fixtures import materialize

LAYOUTS = ["gemma3", "vllm-cpu", "vllm-cpu-fp8", "mla-int8", "deepseek-v4-small", "qwen3-next"]


def _planes(layout):
    return [p for tg in layout.transfer_groups for p in tg.planes] + list(layout.skipped_planes)


@pytest.mark.parametrize("rows", ["tokens", "blocks"])
@pytest.mark.parametrize("name", LAYOUTS)
def test_only_the_given_blocks_change_and_every_row_of_them_does(name: str, rows: str) -> None:
    layout = materialize(load_layout_spec(name), rows=rows)
    groups = max(p.group for p in _planes(layout)) + 1
    block_ids = [[0, 2, 3] if g % 2 == 0 else [1, 0] for g in range(groups)]
    before = {id(p): p.rows_view().clone() for p in _planes(layout)}
    assert poison_blocks(layout, block_ids, seed=1) > 0
    for plane in _planes(layout):
        now, then = plane.rows_view(), before[id(plane)]
        poisoned = {b for b in block_ids[plane.group] if b > 0}
        for block in range(now.shape[0]):
            if block in poisoned:
                # Every row differs (random bytes could match one row by chance only with negligible odds).
                changed = (now[block] != then[block]).flatten(1).any(dim=1)
                assert bool(changed.all()), (plane.layer, plane.name, block)
                if plane.dtype.is_floating_point and plane.dtype.itemsize > 1:
                    values = now[block].contiguous().view(plane.dtype)
                    assert bool(torch.isfinite(values.float()).all())
            elif not any(block in {b for b in block_ids[q.group] if b > 0} for q in _planes(layout)
                         if q.storage is not None and q.storage.data_ptr() == plane.storage.data_ptr()):
                assert torch.equal(now[block], then[block]), (plane.layer, plane.name, block)


def test_one_byte_values_are_finite_in_both_fp8_formats() -> None:
    layout = materialize(load_layout_spec("vllm-cpu-fp8"))
    poison_blocks(layout, [[1, 2, 3]] * 4, seed=3)
    for plane in _planes(layout):
        raw = plane.rows_view()[1:4].contiguous()
        for fp8 in (torch.float8_e4m3fn, torch.float8_e5m2):
            assert bool(torch.isfinite(raw.view(fp8).float()).all())
