"""Chunk parts only where every remote store can read them: a remote connector that keeps no per-object
metadata sizes each read as a whole chunk, so the engine impl then stores chunks whole (and says why)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from lmcache.v1.config import LMCacheEngineConfig

from lmcache_platforms.integration.vllm.lifecycle import whole_chunk_reader
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize


def test_save_chunk_meta_false_for_a_remote_store_means_whole_chunks(tmp_path: Path) -> None:
    url = f"fs://localhost:0{tmp_path}"
    off = LMCacheEngineConfig.from_defaults(chunk_size=64, remote_url=url, extra_config={"save_chunk_meta": False})
    assert whole_chunk_reader(off, None) == "LMCache's extra_config sets save_chunk_meta: false for the remote store"
    on = LMCacheEngineConfig.from_defaults(chunk_size=64, remote_url=url)
    assert whole_chunk_reader(on, None) is None
    no_remote = LMCacheEngineConfig.from_defaults(chunk_size=64, extra_config={"save_chunk_meta": False})
    assert whole_chunk_reader(no_remote, None) is None


@pytest.mark.slow
def test_a_connected_remote_store_without_metadata_is_found_on_the_real_engine(tmp_path: Path) -> None:
    spec = load_layout_spec("gemma3")
    layout = materialize(spec, seed=0)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens),
                             remote_url=f"fs://localhost:0{tmp_path}")
    with LayoutEngine(layout, storage) as engine:
        backend = engine.engine.storage_manager.storage_backends["RemoteBackend"]
        deadline = time.monotonic() + 10
        while backend.connection is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert whole_chunk_reader(None, engine.engine) is None  # the fs connector keeps metadata by default
        backend.connection.save_chunk_meta = False  # what a connector that never keeps it looks like
        assert whole_chunk_reader(None, engine.engine) == (
            f"LMCache's RemoteBackend ({type(backend.connection).__name__}) stores no per-object metadata")
