"""Before an engine closes, chunk writes still in flight to LMCache's slower tiers are waited for, boundedly."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from lmcache_platforms.integration.vllm.pending_writes import drain_writes, pending_writes
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize

pytestmark = pytest.mark.slow


def _disk_engine(tmp_path: Path) -> tuple[LayoutEngine, roundtrip.Request]:
    spec = load_layout_spec("gemma3")
    layout = materialize(spec, "bundled", seed=3)
    size = cache_size_gib(layout, spec.num_tokens)
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=size, local_disk=str(tmp_path),
                             max_local_disk_size=size)
    return LayoutEngine(layout, storage), roundtrip.make_request(layout, spec.num_tokens, 0)


def test_after_draining_every_stored_chunk_is_on_disk(tmp_path: Path) -> None:
    engine, request = _disk_engine(tmp_path)
    with engine:
        engine.store(request.tokens, request.store_ids)
        drain_writes(engine.engine, timeout_s=30)
        assert pending_writes(engine.engine) == 0
        files = sorted(tmp_path.rglob("*lmcp_layout*"))
        assert len(files) == request.stored_tokens // engine.layout.chunk_size
        assert engine.lookup(request.tokens) == request.stored_tokens  # no polling needed once drained


def test_a_write_that_never_finishes_delays_shutdown_only_until_the_time_out(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine, _request = _disk_engine(tmp_path)
    with engine:
        backend = engine.engine.storage_manager.storage_backends["LocalDiskBackend"].disk_worker
        backend.put_tasks.append("stuck-key")  # a write its backend never completes
        try:
            started = time.monotonic()
            with caplog.at_level(logging.WARNING):
                assert drain_writes(engine.engine, timeout_s=0.3) == 1
            assert 0.3 <= time.monotonic() - started < 5.0
            assert pending_writes(engine.engine) == 1
            assert "LMCache still had 1 chunk writes in flight after 0 s" in caplog.text
        finally:
            backend.put_tasks.remove("stuck-key")
