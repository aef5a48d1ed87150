"""A store as a job (``connector.chunk_stores``) through a real LMCacheEngine: what it reports is what it wrote, and
LMCache's own KV events (its ``enable_kv_events``, published by vLLM's ``LMCacheConnectorV1``) still come, one per
chunk, chained as LMCache's store chains them."""

from __future__ import annotations

import torch

from lmcache_platforms.connector.chunk_stores import StoreJob, store
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.connector.remote_reads import parted

CHUNKS = 3


def _job(engine: LayoutEngine, request: roundtrip.Request, skipped_chunks: int = 0) -> StoreJob:
    mask = torch.arange(len(request.tokens)) >= skipped_chunks * engine.layout.chunk_size
    return StoreJob("r", torch.tensor(request.tokens), request.store_ids, engine.tags, mask=mask)


def test_the_result_is_what_the_parts_wrote_and_lmcaches_events_come_once_per_chunk() -> None:
    layout = materialize(load_layout_spec("gemma3"), seed=2)
    chunk = layout.chunk_size
    request = roundtrip.make_request(layout, CHUNKS * chunk, seed=2)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * chunk))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        parted(engine)
        engine.engine.kv_events_enabled, engine.engine.kv_events = True, []  # as enable_kv_events sets them
        connector = engine.connector
        result = store(engine.engine, _job(engine, request, skipped_chunks=1))
        widest, window = connector.part_formats
        reached = [part.name for part in connector.parts]
        # chunks 1 and 2: every part of each (the window part of every chunk: any may end a later hit)
        assert result.chunks == CHUNKS - 1
        assert [None if part is None else part.name for part in result.objects] == \
            [reached[0]] * (CHUNKS - 1) + [reached[1]] * (CHUNKS - 1)
        assert result.bytes == (CHUNKS - 1) * (widest.nbytes + window.nbytes)
        assert sum(result.group_bytes.values()) == sum(
            launch.nbytes for fmt in (widest, window) for launch in fmt.launches) * (CHUNKS - 1)
        assert connector.binding.counters.bytes_stored == result.bytes
        events = engine.engine.get_kv_events()
        keys = [key for _, _, key in engine.engine.token_database.process_tokens(
            tokens=torch.tensor(request.tokens), request_configs={**engine.tags, "lmcache.tag.lmcp_part": reached[0]})]
        assert [event.block_hashes for event in events] == [[key.chunk_hash] for key in keys[1:]]
        assert [event.parent_block_hash for event in events] == [0, keys[1].chunk_hash]
        assert [event.token_ids for event in events] == [request.tokens[chunk:2 * chunk], request.tokens[2 * chunk:]]
        assert engine.lookup(request.tokens) == 0  # chunk 0 was left out by the mask


def test_a_store_into_a_frozen_engine_writes_nothing() -> None:
    layout = materialize(load_layout_spec("llama"), seed=2)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=2)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * layout.chunk_size))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        engine.engine.freeze(True)
        assert store(engine.engine, _job(engine, request)).objects == []
        engine.engine.freeze(False)
        assert store(engine.engine, _job(engine, request)).chunks == CHUNKS
        assert engine.lookup(request.tokens) == CHUNKS * layout.chunk_size
