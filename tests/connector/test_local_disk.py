"""LMCache's local disk backend (no CPU cache, so every load comes from the files) keeps our chunks whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.connector.engine import StorageOptions, cache_size_gib
from lmcache_platforms.layout import load_layout_spec, materialize
from tests.connector.roundtrip_case import round_trip

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(("name", "mode"), [("gemma3", "bundled"), ("deepseek-v4-small", "exploded"),
                                             ("mla-int8", "bundled")])
def test_local_disk_round_trip_is_bit_exact(tmp_path: Path, name: str, mode: str) -> None:
    spec = load_layout_spec(name)
    layout = materialize(spec, mode, seed=7)
    size = cache_size_gib(layout, spec.num_tokens)
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=size, local_disk=str(tmp_path),
                             max_local_disk_size=size)
    result = round_trip(layout, spec.num_tokens, storage)
    assert result["bit_exact"], result["problems"]
    files = sorted(tmp_path.rglob("*lmcp_layout*"))
    assert len(files) == result["chunks_stored"] == result["chunks_hit"]
    # One file per chunk holding every transfer group: a hit restores all groups or none.
    assert {f.stat().st_size for f in files} == {paged_format(layout).nbytes}
