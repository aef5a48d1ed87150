"""A fresh engine's lookup and load of chunks in parts cost one round trip each to Redis (one pipeline), on one
server and on a Redis Cluster, and one thread hand-off (or none) with ``fs://``; LMCache 0.5.6 paid one per
object for a lookup and two (Redis) or four (``fs://``) per object read."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcache_platforms.connector.parts import part_configs
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.layout.parts import chunk_parts
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from lmcache_platforms.tools.redis_server import RedisCluster
from tests.ci import missing
from tests.connector.remote_reads import HandOffs, RoundTrips, parted, remote_connector, upstream_reads
from tests.connector.test_redis_remote import taken_buffer_objects, taken_buffers

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("patient_remote")]

CHUNKS = 4


@pytest.fixture(params=[pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("redis-cluster", marks=pytest.mark.redis)])
def store_url(request: pytest.FixtureRequest, tmp_path: Path, closable_remote_backends: None) -> Iterator[str]:
    if request.param == "redis":
        yield request.getfixturevalue("redis_url")
        return
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing("redis-server or redis-cli is not on PATH (Debian package redis-server; scripts/test_services.sh "
                "installs it)")
    with RedisCluster(str(tmp_path)) as cluster:
        yield cluster.url


def _engine(layout: object, storage: StorageOptions, in_parts: bool) -> LayoutEngine:
    engine = LayoutEngine(layout, storage, kernel_backend="torch")
    return parted(engine) if in_parts else engine


def _stored(url: str, seed: int, in_parts: bool = True) -> tuple[roundtrip.Request, StorageOptions, object]:
    """CHUNKS chunks (in parts, or whole) stored in the remote store alone by an engine now closed."""
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=seed)
    tokens = CHUNKS * layout.chunk_size
    request = roundtrip.make_request(layout, tokens, seed=seed)
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=cache_size_gib(layout, tokens), remote_url=url)
    with _engine(layout, storage, in_parts) as writer:
        writer.store(request.tokens, request.store_ids)
        assert writer.wait_stored(request.tokens, tokens, search_range=["RemoteBackend"]) == tokens
    return request, storage, layout


def _lookup_then_load(request: roundtrip.Request, storage: StorageOptions, layout: object,
                      counter: Callable[[Any], Any]) -> tuple[Any, Any]:
    """What ``counter`` (made on a fresh reader's remote connector) counts for a lookup of the stored hit, then for
    its load (a lookup and pins first, as vLLM's); the load reads every chunk's full-attention part and the
    window part of the last chunk only."""
    tokens = CHUNKS * layout.chunk_size
    with parted(LayoutEngine(layout, storage, kernel_backend="torch")) as reader:
        counted = counter(remote_connector(reader))
        assert reader.lookup(request.tokens) == tokens
        lookup = counted.take()
        assert reader.retrieve(request.tokens, request.load_ids) == tokens
        load = counted.take()
        formats = reader.connector.part_formats
        assert reader.connector.binding.counters.bytes_loaded == CHUNKS * formats[0].nbytes + formats[1].nbytes
    return lookup, load


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "negative-control-upstream"])
def test_a_lookup_and_a_load_are_one_redis_round_trip_per_part(store_url: str, monkeypatch: pytest.MonkeyPatch,
                                                          batched: bool) -> None:
    if not batched:
        upstream_reads(monkeypatch)
    request, storage, layout = _stored(store_url, seed=21)
    trips: list[RoundTrips] = []

    def counted(connector: Any) -> RoundTrips:
        trips.append(RoundTrips(connector, monkeypatch))
        return trips[-1]

    lookup, load = _lookup_then_load(request, storage, layout, counted)
    # A lookup asks once for every object the whole prompt's hit needs: every chunk's full-attention part, the
    # last chunk's window part. A load (as vLLM's: ``LayoutEngine.retrieve``) looks up the same objects, pinning
    # them as it asks, then reads every part's objects from the tier its lookup found them in, in one read, two
    # values each. Every ask is for both values of each object (an ``EXISTS`` each, in the same pipeline).
    # Upstream's lookup asked part by part, and its reads one object at a time.
    if batched:
        assert lookup == [2 * CHUNKS + 2]
        assert load == [2 * CHUNKS + 2, 2 * CHUNKS + 2]
        # On one server the read goes through this package's own connection; on a cluster through redis-py.
        assert trips[0].socket_trips == ([2 * CHUNKS + 2] if store_url.startswith("redis://") else [])
    else:  # one round trip per object asked (the load's lookup), two per object read
        assert lookup == [1] * (CHUNKS + 1)
        assert load == [1] * (3 * (CHUNKS + 1))


@pytest.mark.redis
def test_the_async_lookup_is_one_round_trip(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's asynchronous lookup (async loading) asks the connector's ``batched_async_contains``."""
    request, storage, layout = _stored(redis_url, seed=22)
    with parted(LayoutEngine(layout, storage, kernel_backend="torch")) as reader:
        connector = remote_connector(reader)
        full = reader.connector.parts[0]
        keys = [key for _, _, key in reader.engine.token_database.process_tokens(
            tokens=torch.tensor(request.tokens), request_configs=part_configs(reader.tags, full))]
        trips = RoundTrips(connector, monkeypatch)

        def ask(asked: list[object]) -> int:
            job = connector.batched_async_contains("lookup-0", asked)
            return asyncio.run_coroutine_threadsafe(job, connector.loop).result(timeout=10)

        assert ask(keys) == CHUNKS
        assert trips.take() == [2 * CHUNKS]  # both values of each object
        assert ask([*keys[:1], keys[0].with_new_worker_id(7), *keys[1:]]) == 1  # stops at the first absent key
        assert trips.take() == [2 * (CHUNKS + 1)]


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "negative-control-upstream"])
def test_a_chunk_whose_bytes_are_gone_ends_the_hit_there(store_url: str, monkeypatch: pytest.MonkeyPatch,
                                                          fixed: bool) -> None:
    """An object whose ``kv_bytes`` the store lost and whose ``metadata`` is left (on a cluster the two keys live
    on the nodes of their own slots: a restarted node loses one) ends the hit there: the lookup stops before
    it and deletes the orphan ``metadata``; the chunks before it load, and no buffer stays taken. Upstream's
    lookup asks for the ``metadata`` alone and claims the whole prompt, whose load then comes back short.
    (Whole-chunk objects: in parts, a shorter full-attention part would need a window part the load did not
    read.)"""
    import redis
    import redis.cluster

    if not fixed:
        upstream_reads(monkeypatch)
    earlier = taken_buffer_objects()
    request, storage, layout = _stored(store_url, seed=23, in_parts=False)
    with _engine(layout, storage, in_parts=False) as reader:
        keys = [key for _, _, key in reader.engine.token_database.process_tokens(
            tokens=torch.tensor(request.tokens), request_configs=reader.tags)]
        name = keys[2].to_string()
        port = int(store_url.rsplit(":", 1)[1].split(",")[0])
        client = (redis.cluster.RedisCluster(host="127.0.0.1", port=port) if store_url.startswith("redis-cluster")
                  else redis.Redis(host="127.0.0.1", port=port))
        with client:
            assert client.delete(name + "kv_bytes") == 1
            if not fixed:
                assert reader.lookup(request.tokens) == CHUNKS * layout.chunk_size
                return
            assert reader.lookup(request.tokens) == 2 * layout.chunk_size
            assert client.exists(name + "metadata") == 0
            assert reader.retrieve(request.tokens, request.load_ids) == 2 * layout.chunk_size
        assert reader.lookup(request.tokens) == 2 * layout.chunk_size
    assert taken_buffers(earlier) == 0


@pytest.mark.parametrize("batched", [True, False], ids=["batched", "negative-control-upstream"])
def test_fs_lookups_test_files_in_place_and_a_load_reads_in_one_thread_job(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, closable_remote_backends: None, batched: bool) -> None:
    if not batched:
        upstream_reads(monkeypatch)
    request, storage, layout = _stored(f"fs://localhost:0{tmp_path / 'store'}", seed=24)
    stored = roundtrip.snapshot(layout, request)
    roundtrip.zero_planes(layout)
    lookup, load = _lookup_then_load(request, storage, layout, lambda reader: HandOffs(reader, monkeypatch))
    if batched:  # files tested in the calling thread; one read job for every part's objects
        assert (lookup, load) == (0, 1)
    else:  # a thread job per object asked (the load's lookup, pinning), four per object read
        assert (lookup, load) == (CHUNKS + 1, (CHUNKS + 1) + 4 * (CHUNKS + 1))
    loaded = roundtrip.snapshot(layout, dataclasses.replace(request, store_ids=request.load_ids))
    full_groups = chunk_parts(layout)[0].transfer_groups
    compared = [torch.equal(loaded[place], rows) for place, rows in stored.items()
                if place[1] in full_groups or place[0] == (CHUNKS - 1) * layout.chunk_size]
    assert compared and all(compared)
