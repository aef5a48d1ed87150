"""Multi-group chunks stored through LMCache's Redis remote backend by one engine, loaded by a fresh one."""

from __future__ import annotations

import gc

import pytest

from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.usefixtures("patient_remote")]


@pytest.mark.parametrize(("name", "mode"), [("gemma3", "bundled"), ("deepseek-v4-small", "exploded")])
def test_a_fresh_engine_loads_what_another_stored_in_redis(redis_url: str, name: str, mode: str) -> None:
    spec = load_layout_spec(name)
    layout = materialize(spec, mode, seed=11)
    request = roundtrip.make_request(layout, spec.num_tokens, seed=11)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens), remote_url=redis_url)
    stored = roundtrip.snapshot(layout, request)
    with LayoutEngine(layout, storage) as writer:
        writer.store(request.tokens, request.store_ids)
        assert writer.wait_stored(request.tokens, request.stored_tokens, search_range=["RemoteBackend"]) == \
            request.stored_tokens
    roundtrip.zero_planes(layout)

    with LayoutEngine(layout, storage) as reader:
        assert reader.lookup(request.tokens, search_range=["LocalCPUBackend"]) == 0
        hit = reader.retrieve(request.tokens, request.load_ids)
        verdict = roundtrip.verify(layout, request, stored, hit)
        assert reader.connector.binding.counters.chunks_loaded == request.stored_tokens // layout.chunk_size
    assert hit == request.stored_tokens > 0
    assert verdict.bit_exact, verdict.problems
    assert verdict.rows_checked > 0


def test_chunks_of_another_layout_are_never_found(redis_url: str) -> None:
    spec = load_layout_spec("deepseek-v4-small")
    bundled = materialize(spec, "bundled", seed=1)
    request = roundtrip.make_request(bundled, spec.num_tokens, seed=1)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(bundled, spec.num_tokens), remote_url=redis_url)
    with LayoutEngine(bundled, storage) as writer:
        writer.store(request.tokens, request.store_ids)
        assert writer.wait_stored(request.tokens, request.stored_tokens, search_range=["RemoteBackend"]) == \
            request.stored_tokens
    # Same model, same tokens, but exploded mode orders a chunk's bytes differently: it must miss.
    with LayoutEngine(materialize(spec, "exploded", seed=1), storage) as reader:
        assert reader.lookup(request.tokens) == 0
    with LayoutEngine(materialize(spec, "bundled", seed=2), storage) as reader:
        assert reader.lookup(request.tokens) == request.stored_tokens


def taken_buffer_objects() -> list[object]:
    """LMCache MemoryObjs alive and still referenced."""
    from lmcache.v1.memory_management import MemoryObj

    return [obj for obj in gc.get_objects() if isinstance(obj, MemoryObj) and obj.is_valid() and obj.meta.ref_count > 0]


def taken_buffers(earlier: list[object] | None = None) -> int:
    """LMCache MemoryObjs alive and still referenced (a reader without a CPU cache keeps none after a load), but
    for ``earlier`` (``taken_buffer_objects()`` before the test: what another test of this worker still holds, e.g.
    an engine whose threads are stuck on a store; held here, so no new buffer can take one's place)."""
    return sum(1 for obj in taken_buffer_objects() if not any(obj is old for old in earlier or []))


def test_a_truncated_redis_value_is_a_miss_that_keeps_no_buffer(redis_url: str) -> None:
    """LMCache 0.5.6 allocated the chunk's buffer, then failed copying a value of the wrong length into it and
    never released it (the garbage collector did, much later, logging the leak). With the catalog's
    ``redis_reads`` fix: a miss, and no buffer left taken."""
    import redis

    earlier = taken_buffer_objects()
    spec = load_layout_spec("gemma3")
    layout = materialize(spec, "bundled", seed=3)
    request = roundtrip.make_request(layout, layout.chunk_size, seed=3)
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=cache_size_gib(layout, layout.chunk_size),
                             remote_url=redis_url)
    with LayoutEngine(layout, storage) as writer:
        writer.store(request.tokens, request.store_ids)
        assert writer.wait_stored(request.tokens, request.stored_tokens, search_range=["RemoteBackend"]) == \
            request.stored_tokens
    client = redis.Redis.from_url(redis_url)
    (name,) = client.keys("*kv_bytes")
    client.set(name, client.get(name)[:100])
    with LayoutEngine(layout, storage) as reader:
        assert reader.retrieve(request.tokens, request.load_ids) == 0
        assert taken_buffers(earlier) == 0
