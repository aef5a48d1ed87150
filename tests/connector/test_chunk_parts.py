"""Chunk parts through a real LMCacheEngine with the local CPU backend: the same stored bytes, a load reads the
window part of the last chunks only, and an evicted part is handled all-or-nothing (lookup and load)."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.connector.parts import part_configs
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.layout.parts import longest_hit, needed_chunks
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.connector.remote_reads import parted as in_parts

CHUNKS = 4


@pytest.fixture
def parted():
    """An engine over the gemma3 example (full attention + a 32-token window, 64-token chunks), chunks in
    parts, with 4 chunks stored; yields (engine, request, the stored rows)."""
    layout = materialize(load_layout_spec("gemma3"), seed=5)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=1)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * layout.chunk_size))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        in_parts(engine)
        stored = roundtrip.snapshot(layout, request)
        engine.store(request.tokens, request.store_ids)
        yield engine, request, stored


def _remove(engine: LayoutEngine, request, part_name: str, chunk: int) -> None:
    """Evict one part of one chunk from every tier, as the LRU would."""
    part = next(p for p in engine.connector.parts if p.name == part_name)
    configs = part_configs(engine.tags, part)
    keys = [key for _, _, key in engine.engine.token_database.process_tokens(
        tokens=torch.tensor(request.tokens), request_configs=configs)]
    assert engine.engine.storage_manager.remove(keys[chunk])


def _loaded(engine: LayoutEngine, request) -> dict:
    return roundtrip.snapshot(engine.layout, dataclasses.replace(request, store_ids=request.load_ids))


def test_parts_store_the_same_bytes_and_a_load_reads_only_the_window_it_needs(parted) -> None:
    engine, request, stored = parted
    layout = engine.layout
    full, window = engine.connector.parts
    assert (full.reach, window.reach) == (None, 32)
    counters = engine.connector.binding.counters
    fmts = engine.connector.part_formats
    # The same payload; each part object adds its own checksum trailer, padded to one more "token" column.
    assert sum(f.payload_bytes for f in fmts) == paged_format(layout).payload_bytes
    assert counters.bytes_stored == CHUNKS * sum(f.nbytes for f in fmts)
    assert all(f.nbytes == f.payload_bytes + layout.chunk_size for f in fmts)
    assert engine.lookup(request.tokens) == CHUNKS * layout.chunk_size
    roundtrip.zero_planes(layout)
    assert engine.retrieve(request.tokens, request.load_ids) == CHUNKS * layout.chunk_size
    assert counters.bytes_loaded == CHUNKS * fmts[0].nbytes + 1 * fmts[1].nbytes
    loaded = _loaded(engine, request)
    for (start, tg, plane), rows in stored.items():
        if tg in full.transfer_groups or start == (CHUNKS - 1) * layout.chunk_size:
            assert torch.equal(loaded[(start, tg, plane)], rows), (start, tg, plane)
        else:  # a window chunk before the last window: never read
            assert not loaded[(start, tg, plane)].any(), (start, tg, plane)


def test_an_evicted_early_window_part_keeps_the_hit(parted) -> None:
    engine, request, _ = parted
    _remove(engine, request, "reach32", 0)
    assert engine.lookup(request.tokens) == CHUNKS * engine.layout.chunk_size
    assert engine.retrieve(request.tokens, request.load_ids) == CHUNKS * engine.layout.chunk_size


@pytest.mark.parametrize(("part", "chunk", "hit_chunks"), [("reach32", CHUNKS - 1, CHUNKS - 1),
                                                           ("all", 1, 1)])
def test_an_evicted_needed_part_shortens_the_hit_and_a_load_past_it_writes_nothing(parted, part: str, chunk: int,
                                                                                  hit_chunks: int,
                                                                                  caplog: pytest.LogCaptureFixture
                                                                                  ) -> None:
    """The load's one check of every part's objects names the part and chunk that is gone."""
    engine, request, _ = parted
    chunk_size = engine.layout.chunk_size
    _remove(engine, request, part, chunk)
    assert engine.lookup(request.tokens) == hit_chunks * chunk_size
    roundtrip.zero_planes(engine.layout)
    before = engine.connector.binding.counters.bytes_loaded
    with caplog.at_level(logging.WARNING):
        assert engine.retrieve(request.tokens, request.load_ids) == 0  # the whole hit asked for: none of it
    assert f"part {part} of chunk {chunk} of a {CHUNKS * chunk_size}-token hit is gone: nothing loaded" in caplog.text
    assert engine.connector.binding.counters.bytes_loaded == before
    assert not any(rows.any() for rows in _loaded(engine, request).values())
    # The shorter hit the lookup reported loads in full.
    assert engine.retrieve(request.tokens[: hit_chunks * chunk_size], request.load_ids) == hit_chunks * chunk_size


def test_a_lookup_pins_every_needed_part_and_nothing_else(parted) -> None:
    engine, request, _ = parted
    lmcache = engine.engine
    assert lmcache.lookup(torch.tensor(request.tokens), lookup_id="r1", pin=True,
                          request_configs=engine.tags) == CHUNKS * engine.layout.chunk_size
    (location, keys), = lmcache.lookup_pins["r1"].items()
    assert location == "LocalCPUBackend" and len(keys) == CHUNKS + 1  # every full part, the last window part
    lmcache.lookup_unpin("r1")
    assert "r1" not in lmcache.lookup_pins


def test_a_lookup_pins_as_it_asks_and_keeps_only_what_its_hit_needs(parted) -> None:
    """The last chunk's window part gone: the full parts of all four chunks and the window parts found were pinned
    as they were asked; the hit (three chunks) keeps the first three full parts and the third chunk's window part,
    every other object is unpinned before the lookup returns, and ``lookup_unpin`` releases the rest. With no hit,
    nothing stays pinned."""
    engine, request, _ = parted
    chunk_size = engine.layout.chunk_size
    _remove(engine, request, "reach32", CHUNKS - 1)
    lmcache = engine.engine
    cpu = lmcache.storage_manager.storage_backends["LocalCPUBackend"]
    assert lmcache.lookup(torch.tensor(request.tokens), lookup_id="r1", pin=True,
                          request_configs=engine.tags) == (CHUNKS - 1) * chunk_size
    kept = lmcache.lookup_pins["r1"]["LocalCPUBackend"]
    assert len(kept) == CHUNKS - 1 + 1
    assert {key for key, obj in cpu.hot_cache.items() if obj.is_pinned} == set(kept)
    lmcache.lookup_unpin("r1")
    assert not any(obj.is_pinned for obj in cpu.hot_cache.values())
    for chunk in range(CHUNKS - 1):  # every window part gone: no hit, the full parts it pinned all unpinned
        _remove(engine, request, "reach32", chunk)
    assert lmcache.lookup(torch.tensor(request.tokens), lookup_id="r2", pin=True, request_configs=engine.tags) == 0
    assert "r2" not in lmcache.lookup_pins and not any(obj.is_pinned for obj in cpu.hot_cache.values())


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(held=st.lists(st.lists(st.booleans(), min_size=CHUNKS, max_size=CHUNKS), min_size=2, max_size=2))
def test_a_lookup_finds_the_longest_hit_every_part_holds_and_pins_exactly_its_objects(parted, held) -> None:
    """Any objects of either part gone: the lookup (asking the whole hit first, then on from a miss) reports the
    longest hit ``layout.parts.longest_hit`` computes from what is held, keeps pinned exactly the objects that
    hit needs, and the hit loads in full."""
    engine, request, _ = parted
    chunk_size = engine.layout.chunk_size
    lmcache = engine.engine
    cpu = lmcache.storage_manager.storage_backends["LocalCPUBackend"]
    engine.store(request.tokens, request.store_ids)  # what an earlier example removed, stored again
    keys = []
    for part, flags in zip(engine.connector.parts, held, strict=True):
        part_keys = [key for _, _, key in lmcache.token_database.process_tokens(
            tokens=torch.tensor(request.tokens), request_configs=part_configs(engine.tags, part))]
        keys.append(part_keys)
        for key, kept in zip(part_keys, flags, strict=True):
            if not kept:
                assert lmcache.storage_manager.remove(key)
    ends = [(i + 1) * chunk_size for i in range(CHUNKS)]
    expected = longest_hit([(part.reach, flags) for part, flags in zip(engine.connector.parts, held, strict=True)],
                           ends)
    assert lmcache.lookup(torch.tensor(request.tokens), lookup_id="p", pin=True,
                          request_configs=engine.tags) == expected
    needed = {keys[p][i] for p, part in enumerate(engine.connector.parts)
              for i in needed_chunks(part.reach, expected, chunk_size)}
    assert {key for key, obj in cpu.hot_cache.items() if obj.is_pinned} == needed
    assert set(lmcache.lookup_pins.get("p", {}).get("LocalCPUBackend", [])) == needed
    lmcache.lookup_unpin("p")
    assert not any(obj.is_pinned for obj in cpu.hot_cache.values())
    if expected:
        assert engine.retrieve(request.tokens[:expected], request.load_ids) == expected


@pytest.mark.parametrize("name", ["llama", "mla-int8"])
def test_layouts_with_one_reach_keep_one_object_per_chunk(name: str) -> None:
    layout = materialize(load_layout_spec(name), seed=0)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, layout.chunk_size))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        whole = engine.connector.binding.fingerprint
        engine.connector.bind(layout, split=True)
        assert engine.connector.parts == ()
        assert engine.connector.binding.fingerprint == whole


def test_state_parts_are_stored_only_where_the_caller_kept_a_state() -> None:
    """qwen3-next (full attention + recurrent snapshots): with ``state_ends`` the snapshot part of chunk 2 alone
    is stored, so the longest hit is 2 chunks, a load of more writes nothing, and the 2-chunk hit is exact."""
    layout = materialize(load_layout_spec("qwen3-next"), seed=5)
    chunk = layout.chunk_size
    request = roundtrip.make_request(layout, CHUNKS * chunk, seed=1)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * chunk))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        in_parts(engine)
        assert [p.snapshots for p in engine.connector.parts] == [False, True]
        stored = roundtrip.snapshot(layout, request)
        engine.engine.store(torch.tensor(request.tokens), block_ids=request.store_ids, request_configs=engine.tags,
                            state_ends=(2 * chunk,))
        fmts = engine.connector.part_formats
        assert engine.connector.binding.counters.bytes_stored == CHUNKS * fmts[0].nbytes + fmts[1].nbytes
        assert engine.lookup(request.tokens) == 2 * chunk
        roundtrip.zero_planes(layout)
        assert engine.retrieve(request.tokens, request.load_ids) == 0
        assert not any(rows.any() for rows in _loaded(engine, request).values())
        assert engine.retrieve(request.tokens[: 2 * chunk], request.load_ids) == 2 * chunk
        loaded = _loaded(engine, request)
    snapshot = engine.connector.parts[1].transfer_groups
    for (start, tg, plane), rows in stored.items():
        if start < 2 * chunk and (tg not in snapshot or start == chunk):
            assert torch.equal(loaded[(start, tg, plane)], rows), (start, tg, plane)
        else:
            assert not loaded[(start, tg, plane)].any(), (start, tg, plane)


@functools.cache
def _token_database(chunk: int) -> Any:
    """LMCache's token database for ``chunk``-token chunks, as an engine builds it."""
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    from lmcache_platforms.tools.engine import engine_config

    metadata = LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.uint8, kv_shape=(1, 2, chunk, 1, 1), chunk_size=chunk)
    return ChunkedTokenDatabase(engine_config(chunk, StorageOptions()), metadata)


@given(st.lists(st.booleans(), min_size=1, max_size=6), st.sampled_from([16, 64]), st.integers(0, 6), st.booleans())
def test_a_store_keys_every_chunk_but_those_of_state_parts_not_ending_at_a_kept_state(kept, chunk, skipped, split):
    """``chunk_stores`` keys, from LMCache's own token database, every chunk after the skipped prefix of a part
    without recurrent states, and of a part with them (or of whole chunks) only those ending where a state was
    kept; each under its part's key tag."""
    from types import SimpleNamespace

    from lmcache_platforms.connector import chunk_stores
    from lmcache_platforms.layout.parts import chunk_parts

    parts = chunk_parts(materialize(load_layout_spec("qwen3-next"), seed=0)) if split else ()
    database = _token_database(chunk)
    tokens = torch.arange(len(kept) * chunk)
    first = min(skipped, len(kept)) * chunk
    mask = torch.arange(len(tokens)) >= first
    ends = [(i + 1) * chunk for i, keep in enumerate(kept) if keep]
    job = chunk_stores.StoreJob("r", tokens, [], {"tag": 1}, mask=mask, state_ends=ends)
    keyed = chunk_stores._chunks(SimpleNamespace(token_database=database), parts, job, job.wanted())
    every = [(end - chunk, end) for end in range(chunk, len(tokens) + 1, chunk) if end > first]
    at_states = [(start, end) for start, end in every if end in ends]
    expected = [(None, at_states)] if not parts else [(part, every if not part.snapshots else at_states)
                                                      for part in parts]
    assert [(part, [(start, end) for start, end, _ in chunks]) for part, chunks in keyed] == \
        [(part, bounds) for part, bounds in expected if bounds]
    for part, chunks in keyed:
        configs = {"tag": 1} if part is None else part_configs({"tag": 1}, part)
        assert [key for _, _, key in chunks] == [key for start, end, key in database.process_tokens(
            tokens=tokens, mask=mask, request_configs=configs) if (start, end) in {c[:2] for c in chunks}]


def test_a_run_held_by_two_tiers_out_of_their_order_is_found_and_pinned_where_each_object_is(tmp_path) -> None:
    """``_held_run`` asks the storage manager a run of objects at once (each tier in turn takes the prefix it
    holds); where that stops at an object a later-asked tier does not hold but an earlier one does (chunk 1 only
    on disk, chunk 2 only in the CPU cache), it asks that object alone and resumes, so every held object counts,
    as when each was asked alone, and each is pinned in the tier that holds it."""
    from lmcache_platforms.connector.parts import _held_run

    layout = materialize(load_layout_spec("gemma3"), seed=6)
    tokens = CHUNKS * layout.chunk_size
    request = roundtrip.make_request(layout, tokens, seed=6)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, tokens), local_disk=str(tmp_path),
                             max_local_disk_size=cache_size_gib(layout, tokens))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        engine.store(request.tokens, request.store_ids)
        assert engine.wait_stored(request.tokens, tokens, search_range=["LocalDiskBackend"]) == tokens
        manager = engine.engine.storage_manager
        keys = [key for _, _, key in engine.engine.token_database.process_tokens(
            tokens=torch.tensor(request.tokens), request_configs=engine.tags)]
        assert manager.storage_backends["LocalCPUBackend"].remove(keys[1])
        assert manager.storage_backends["LocalDiskBackend"].remove(keys[2])
        assert manager.batched_contains(keys)[0] == 2  # the batch alone: CPU holds chunk 0, disk then 1, not 2
        held, where = _held_run(manager, keys, None, True)
        assert held == CHUNKS
        assert where == {"LocalCPUBackend": [keys[0], keys[2], keys[3]], "LocalDiskBackend": [keys[1]]}
        cpu = manager.storage_backends["LocalCPUBackend"]
        assert [cpu.hot_cache[k].is_pinned for k in (keys[0], keys[2], keys[3])] == [True, True, True]
        for location, pinned in where.items():
            manager.batched_unpin(pinned, [location])
        assert not any(cpu.hot_cache[k].is_pinned for k in (keys[0], keys[2], keys[3]))
        assert manager.storage_backends["LocalDiskBackend"].remove(keys[1])
        assert _held_run(manager, keys, None, False) == (1, {"LocalCPUBackend": [keys[0]]})


@pytest.mark.parametrize("placed", [True, False], ids=["placed", "negative-control-upstream"])
def test_a_load_reads_each_object_from_the_tier_its_lookup_found_it_in(tmp_path, monkeypatch: pytest.MonkeyPatch,
                                                                     placed: bool) -> None:
    """Full-attention parts held by two tiers out of their order (chunk 1 only on disk, chunk 2 only in the CPU
    cache) load in full, bit for bit, each read from where the lookup before the load found and pinned it, and
    no tier is asked again. Negative control: a load that reads every object from the CPU cache (where upstream's
    retrieve, asking each tier for a prefix of the chunks left, looks for chunk 1) finds chunk 1 missing there,
    and loads nothing."""
    from lmcache_platforms.connector import chunk_loads

    if not placed:
        monkeypatch.setattr(chunk_loads, "where_held",
                            lambda _engine, keys, _req: (len(keys), dict.fromkeys(keys, "LocalCPUBackend")))
    layout = materialize(load_layout_spec("gemma3"), seed=7)
    tokens = CHUNKS * layout.chunk_size
    request = roundtrip.make_request(layout, tokens, seed=7)
    size = cache_size_gib(layout, tokens)
    storage = StorageOptions(max_local_cpu_size=size, local_disk=str(tmp_path), max_local_disk_size=size)
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        in_parts(engine)
        stored = roundtrip.snapshot(layout, request)
        engine.store(request.tokens, request.store_ids)
        assert engine.wait_stored(request.tokens, tokens, search_range=["LocalDiskBackend"]) == tokens
        full = engine.connector.parts[0]
        keys = [key for _, _, key in engine.engine.token_database.process_tokens(
            tokens=torch.tensor(request.tokens), request_configs=part_configs(engine.tags, full))]
        manager = engine.engine.storage_manager
        assert manager.storage_backends["LocalCPUBackend"].remove(keys[1])
        assert manager.storage_backends["LocalDiskBackend"].remove(keys[2])
        assert engine.lookup(request.tokens) == tokens
        roundtrip.zero_planes(layout)
        asked = []
        monkeypatch.setattr(manager.storage_backends["LocalDiskBackend"], "batched_contains",
                            _counted(manager.storage_backends["LocalDiskBackend"].batched_contains, asked))
        loaded_tokens = engine.retrieve(request.tokens, request.load_ids)
        if not placed:
            assert loaded_tokens == 0
            return
        assert loaded_tokens == tokens
        # The disk is asked once, by the lookup before the load (for the 3 full-attention parts after the CPU
        # cache's prefix and the last window part): the load reads each where the lookup pinned it.
        assert asked == [CHUNKS]
        loaded = _loaded(engine, request)
    compared = [torch.equal(loaded[place], rows) for place, rows in stored.items()
                if place[1] in full.transfer_groups or place[0] == (CHUNKS - 1) * layout.chunk_size]
    assert compared and all(compared)


def _counted(method, asked: list[int]):
    def counting(keys, *args, **kwargs):
        asked.append(len(keys))
        return method(keys, *args, **kwargs)

    return counting
