"""LMCache's local disk backend (no CPU cache, so every load comes from the files) keeps our chunks whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from lmcache_platforms import ensure_patched
from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.integration.vllm.pending_writes import drain_writes
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
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


@pytest.mark.parametrize(("chunks", "damage"), [(1, "cut"), (1, "delete"), (3, "cut"), (3, "delete")])
def test_chunk_files_cut_short_or_deleted_are_never_loaded(tmp_path: Path, chunks: int, damage: str) -> None:
    """LMCache 0.5.6 loaded a chunk file cut short as a hit (its tail: the buffer's stale bytes), and on its
    single-chunk read (one chunk) a deleted file too (then failing on its own index); with the catalog's
    ``disk_reads`` fix each is a miss."""
    ensure_patched()  # as activation does in vLLM; this test builds LMCache without vLLM's plugin loader
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=7)
    num_tokens = chunks * layout.chunk_size
    request = roundtrip.make_request(layout, num_tokens)
    size = cache_size_gib(layout, num_tokens)
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=size, local_disk=str(tmp_path),
                             max_local_disk_size=size)
    with LayoutEngine(layout, storage) as engine:
        engine.store(request.tokens, request.store_ids)
        assert engine.wait_stored(request.tokens, request.stored_tokens) == request.stored_tokens
        drain_writes(engine.engine, timeout_s=30)  # a file is indexed before its write ends
        files = sorted(tmp_path.rglob("*lmcp_layout*"))
        assert len(files) == chunks
        for path in files:
            if damage == "cut":
                path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
            else:
                path.unlink()
        assert engine.retrieve(request.tokens, request.load_ids) == 0
        assert engine.connector.binding.counters.chunks_loaded == 0
        assert engine.lookup(request.tokens) == 0  # the broken chunks left the index
