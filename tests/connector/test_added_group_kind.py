"""A group kind added as one class (``tests/layout/tail_window.py``: a sliding window written from its definition
alone) runs through a real LMCache engine exactly as the built-in sliding window does: same chunk parts, same
selftest summary, every plane byte for byte the same after the load. The same class with a planted fault (the
window's first row dropped) still round-trips consistently with itself, and the comparison catches it."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from lmcache_platforms.layout import GroupKind, LayoutSpec, load_layout_spec
from lmcache_platforms.layout.parts import chunk_parts
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.layout.tail_window import TailWindow, TailWindowMissingItsFirstRow


def _with_kind(spec: LayoutSpec, kind: GroupKind | None) -> LayoutSpec:
    """``spec`` with every sliding-window group given ``kind`` (None: the built-in one)."""
    groups = tuple(dataclasses.replace(g, kind=kind) if kind is not None and g.sliding_window else g
                   for g in spec.groups)
    return dataclasses.replace(spec, groups=groups)


def _round_trip(spec: LayoutSpec, kind: GroupKind | None) -> tuple[dict[str, Any], list[Any], list[torch.Tensor]]:
    """Store the spec's tokens through a real LMCache engine, wipe, load into other blocks: the selftest summary,
    the chunk parts, and every plane's bytes after the load."""
    layout = materialize(_with_kind(spec, kind), seed=5)
    request = roundtrip.make_request(layout, spec.num_tokens, seed=5)
    parts = [(p.reach, p.transfer_groups, p.bytes_per_chunk) for p in chunk_parts(layout)]
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        summary = engine.round_trip(request, spec.name)
    return summary, parts, [plane.rows_view().clone() for plane in roundtrip.all_planes(layout)]


@pytest.mark.parametrize("example", ["gemma3", "deepseek-v4-small"])
def test_a_kind_added_as_one_class_runs_through_a_real_engine_as_the_built_in_one(example: str) -> None:
    spec = load_layout_spec(example)
    summary, parts, planes = _round_trip(spec, None)
    assert summary["bit_exact"] and summary["tokens_hit"] == summary["tokens_stored"] > 0, summary
    for kind, same in ((TailWindow(), True), (TailWindowMissingItsFirstRow(), False)):
        other_summary, other_parts, other_planes = _round_trip(spec, kind)
        identical = all(torch.equal(a, b) for a, b in zip(planes, other_planes, strict=True))
        assert identical is same, kind
        if same:
            assert (other_summary, other_parts) == (summary, parts)
        else:
            assert other_summary["bit_exact"], "the faulty kind is consistent with itself: only the comparison fails"
            assert other_summary["rows_checked"] < summary["rows_checked"]
