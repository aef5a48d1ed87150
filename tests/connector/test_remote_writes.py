"""Writes to Redis sent as one batch count as in flight until they land, so an engine about to close waits for
them (``integration.vllm.pending_writes``); LMCache 0.5.6 tracked only writes sent one key at a time."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from lmcache_platforms.integration.vllm.pending_writes import drain_writes, pending_writes
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.connector.remote_reads import remote_connector
from tests.upstream_originals import put_back

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.usefixtures("patient_remote")]

CHUNKS = 4


@pytest.fixture
def held_writes(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LayoutEngine, Any, Any]]:
    """An engine storing to Redis alone whose writes wait for ``release`` before they reach Redis."""
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=5)
    tokens = CHUNKS * layout.chunk_size
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=cache_size_gib(layout, tokens), remote_url=redis_url)
    release = threading.Event()
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        connector = remote_connector(engine)
        write = connector._put

        async def held(key: Any, memory_obj: Any) -> None:
            while not release.is_set():
                await asyncio.sleep(0.005)
            await write(key, memory_obj)

        monkeypatch.setattr(connector, "_put", held)
        try:
            yield engine, roundtrip.make_request(layout, tokens, seed=5), release
        finally:
            release.set()


def _stored_objects(url: str) -> int:
    client = redis.Redis.from_url(url)
    try:
        return len(client.keys("*kv_bytes"))
    finally:
        client.close()


def test_a_batch_of_writes_is_in_flight_until_it_lands_and_draining_waits_for_it(held_writes, redis_url):
    engine, request, release = held_writes
    engine.store(request.tokens, request.store_ids)
    assert pending_writes(engine.engine) == CHUNKS
    assert _stored_objects(redis_url) == 0
    release.set()
    assert drain_writes(engine.engine, timeout_s=30) == CHUNKS
    assert pending_writes(engine.engine) == 0
    assert _stored_objects(redis_url) == CHUNKS


def test_without_the_fix_a_batch_of_writes_looks_landed_while_it_is_held(held_writes, redis_url, monkeypatch):
    """Negative control: LMCache's own ``batched_submit_put_task`` back; the count above would see nothing."""
    assert len(put_back(monkeypatch, lambda patch: patch.target.endswith("RemoteBackend.batched_submit_put_task"))) == 1
    engine, request, release = held_writes
    engine.store(request.tokens, request.store_ids)
    assert pending_writes(engine.engine) == 0
    assert _stored_objects(redis_url) == 0
    release.set()
