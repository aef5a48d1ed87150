"""Chunks in parts stored through LMCache's Redis Cluster remote backend (``redis-cluster://``, a real local
3-master cluster) by one engine, found and loaded bit for bit by a fresh one: the scale-out store that several
vLLM servers share. A chunk's parts have their own keys, so they land on different nodes."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.connector.parts import part_configs
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from lmcache_platforms.tools.redis_server import RedisCluster
from tests.ci import missing
from tests.connector.remote_reads import parted, upstream_reads
from tests.connector.test_redis_remote import taken_buffer_objects, taken_buffers

pytestmark = [pytest.mark.slow, pytest.mark.redis, pytest.mark.usefixtures("patient_remote")]

CHUNKS = 4


@pytest.fixture
def cluster(tmp_path: Path, closable_remote_backends: None) -> Iterator[RedisCluster]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing("redis-server or redis-cli is not on PATH (Debian package redis-server; scripts/test_services.sh "
                "installs it)")
    with RedisCluster(str(tmp_path)) as started:
        yield started


def _keys_per_node(cluster: RedisCluster) -> dict[int, dict[str, int]]:
    """Per node: how many ``metadata`` keys of each part (by its key tag) it holds."""
    import redis

    held: dict[int, dict[str, int]] = {}
    for port in cluster.ports:
        with redis.Redis(host="127.0.0.1", port=port) as node:
            names = [name.decode() for name in node.keys("*metadata")]
        held[port] = {part: sum(f"lmcp_part%{part}" in name for name in names) for part in ("all", "reach32")}
    return held


def _delete_part(cluster: RedisCluster, engine: LayoutEngine, tokens: list[int], part_name: str, chunk: int) -> int:
    """Delete one part of one chunk from the node holding it; that node's port."""
    import redis.cluster

    part = next(p for p in engine.connector.parts if p.name == part_name)
    keys = [key for _, _, key in engine.engine.token_database.process_tokens(
        tokens=torch.tensor(tokens), request_configs=part_configs(engine.tags, part))]
    name = keys[chunk].to_string() + "metadata"
    with redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as client:
        assert client.delete(name) == 1
        return int(client.get_node_from_key(name).port)


def test_a_fresh_engine_loads_parts_another_stored_across_a_redis_cluster(cluster: RedisCluster) -> None:
    spec = load_layout_spec("gemma3")  # full attention + a 32-token window: two parts per 64-token chunk
    layout = materialize(spec, "bundled", seed=13)
    tokens = CHUNKS * layout.chunk_size
    request = roundtrip.make_request(layout, tokens, seed=13)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, tokens), remote_url=cluster.url)
    stored = roundtrip.snapshot(layout, request)
    with parted(LayoutEngine(layout, storage, kernel_backend="torch")) as writer:
        assert [p.name for p in writer.connector.parts] == ["all", "reach32"]
        writer.store(request.tokens, request.store_ids)
        assert writer.wait_stored(request.tokens, tokens, search_range=["RemoteBackend"]) == tokens
    held = _keys_per_node(cluster)
    assert sum(n["all"] for n in held.values()) == CHUNKS and sum(n["reach32"] for n in held.values()) == CHUNKS
    assert sum(1 for n in held.values() if n["all"] + n["reach32"]) > 1, held  # spread over the nodes
    roundtrip.zero_planes(layout)

    with parted(LayoutEngine(layout, storage, kernel_backend="torch")) as reader:
        assert reader.lookup(request.tokens, search_range=["LocalCPUBackend"]) == 0
        assert reader.lookup(request.tokens) == tokens
        assert reader.retrieve(request.tokens, request.load_ids) == tokens
        counters = reader.connector.binding.counters
        full, _ = reader.connector.parts
        formats = reader.connector.part_formats
        # Every chunk's full-attention part, the window part of the last chunk only (the window's 32 tokens).
        assert counters.bytes_loaded == CHUNKS * formats[0].nbytes + 1 * formats[1].nbytes
        assert counters.bytes_loaded < CHUNKS * paged_format(layout).nbytes
    loaded = roundtrip.snapshot(layout, dataclasses.replace(request, store_ids=request.load_ids))
    compared = 0
    for (start, group, plane), rows in stored.items():
        if group in full.transfer_groups or start == (CHUNKS - 1) * layout.chunk_size:
            assert torch.equal(loaded[(start, group, plane)], rows), (start, group, plane)
            compared += rows.numel()
        else:  # a window chunk before the last window: never read
            assert not loaded[(start, group, plane)].any(), (start, group, plane)
    assert compared > 0

    # Negative control: the hits are the cluster's. Without chunk 2's full-attention part, on whichever node it
    # lived, a fresh engine finds exactly the two chunks before it.
    with parted(LayoutEngine(layout, storage, kernel_backend="torch")) as reader:
        _delete_part(cluster, reader, request.tokens, "all", 2)
        assert reader.lookup(request.tokens) == 2 * layout.chunk_size


def _one_chunk(cluster: RedisCluster, seed: int) -> tuple[KVLayout, roundtrip.Request, StorageOptions]:
    """The gemma3 example, one chunk's request, and storage in the cluster alone."""
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=seed)
    request = roundtrip.make_request(layout, layout.chunk_size, seed=seed)
    storage = StorageOptions(local_cpu=False, max_local_cpu_size=cache_size_gib(layout, layout.chunk_size),
                             remote_url=cluster.url)
    return layout, request, storage


def _store_remotely(engine: LayoutEngine, request: roundtrip.Request) -> None:
    engine.store(request.tokens, request.store_ids)
    assert engine.wait_stored(request.tokens, request.stored_tokens, search_range=["RemoteBackend"]) == \
        request.stored_tokens


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "negative-control-upstream"])
def test_a_truncated_value_in_the_cluster_is_a_miss_that_keeps_no_buffer(
        cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, fixed: bool) -> None:
    """LMCache 0.5.6's cluster connector, like its Redis one, kept the chunk's buffer taken when a value had the
    wrong length; the catalog's ``redis_reads`` fix covers both, batched or not (upstream's own reads, one
    object at a time, are the control)."""
    import redis.cluster
    from lmcache.v1.storage_backend.connector.redis_connector import RedisClusterConnector

    from lmcache_platforms.upstream_fixes.redis_reads import redis_cluster_get

    assert RedisClusterConnector._get is redis_cluster_get
    if not fixed:
        upstream_reads(monkeypatch)

    earlier = taken_buffer_objects()
    layout, request, storage = _one_chunk(cluster, seed=3)
    with LayoutEngine(layout, storage) as writer:
        _store_remotely(writer, request)
    with redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as client:
        (name,) = client.keys("*kv_bytes", target_nodes=redis.cluster.RedisCluster.ALL_NODES)
        client.set(name, client.get(name)[:100])
    with LayoutEngine(layout, storage) as reader:
        assert reader.lookup(request.tokens) == request.stored_tokens  # the metadata is there
        assert reader.retrieve(request.tokens, request.load_ids) == 0
        assert taken_buffers(earlier) == (0 if fixed else 1)


def test_a_same_size_corrupt_value_is_refused_and_deleted_from_the_cluster(cluster: RedisCluster) -> None:
    """A value overwritten with as many other bytes fails its checksum: no token loaded, and the chunk's two keys
    are deleted from the node holding them (the Redis Cluster connector's remove_sync comes from the catalog)."""
    import redis.cluster

    layout, request, storage = _one_chunk(cluster, seed=4)
    with LayoutEngine(layout, storage) as engine:
        _store_remotely(engine, request)
        with redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as client:
            (name,) = client.keys("*kv_bytes", target_nodes=redis.cluster.RedisCluster.ALL_NODES)
            value = bytearray(client.get(name))
            value[len(value) // 2] ^= 1
            client.set(name, bytes(value))
            assert engine.retrieve(request.tokens, request.load_ids) == 0
            assert client.keys("*", target_nodes=redis.cluster.RedisCluster.ALL_NODES) == []
        assert engine.lookup(request.tokens) == 0


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "negative-control-first-answers-kept"])
def test_a_lookup_meeting_a_write_between_the_two_nodes_keeps_the_chunk(
        cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, fixed: bool) -> None:
    """A writer sets a chunk's bytes, then its metadata; on a cluster the two keys live on their own nodes, and a
    lookup's pipeline asks both nodes at once, so under load it can read the bytes before the writer set them
    and the metadata after. Planted: the bytes are set just after the lookup's pipeline read them absent. The
    chunk must be found and stay stored. The control keeps that pipeline's answers (no second look): the chunk
    is taken for an orphan, its metadata deleted, and every later lookup misses a chunk whose two values had
    both been written (a CI run met this: a store that never became findable)."""
    import redis.cluster

    from lmcache_platforms.upstream_fixes import redis_reads

    layout, request, storage = _one_chunk(cluster, seed=5)
    with LayoutEngine(layout, storage) as writer:
        _store_remotely(writer, request)
    pipeline, pipelines = redis_reads._pipeline, []
    with redis.cluster.RedisCluster(host="127.0.0.1", port=cluster.ports[0]) as client:
        (name,) = client.keys("*kv_bytes", target_nodes=redis.cluster.RedisCluster.ALL_NODES)
        value = client.get(name)
        assert client.delete(name) == 1

        def planted(redis_client: object) -> object:
            pipe = pipeline(redis_client)
            pipelines.append(pipe)
            first, execute = len(pipelines) == 1, pipe.execute

            async def execute_planted() -> list[object]:
                answers = await execute()
                if first:
                    client.set(name, value)  # the writer's set lands between the two nodes' answers
                return answers if first or fixed else [0] * len(answers)

            pipe.execute = execute_planted
            return pipe

        monkeypatch.setattr(redis_reads, "_pipeline", planted)
        with LayoutEngine(layout, storage) as reader:
            found = reader.lookup(request.tokens, search_range=["RemoteBackend"])
            monkeypatch.setattr(redis_reads, "_pipeline", pipeline)
            later = reader.lookup(request.tokens, search_range=["RemoteBackend"])
        metadata = client.keys("*metadata", target_nodes=redis.cluster.RedisCluster.ALL_NODES)
    assert len(pipelines) == 2  # the planted read, and the second look at the bytes it missed
    stored = request.stored_tokens
    assert (found, later, len(metadata)) == ((stored, stored, 1) if fixed else (0, 0, 0))
