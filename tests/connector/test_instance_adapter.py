"""``instance_adapter.adapt_engine`` on a real LMCacheEngine: every call rebuilds the engine's methods from the
instance's own (never a wrapper of a wrapper), and the key tags of the last call are the ones its lookups carry."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from lmcache_platforms.connector.instance_adapter import INSTANCE_CHANGES, adapt_engine
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize

CHUNKS = 3
ADAPTED = ("store", "lookup")


def _depth(engine: Any, name: str) -> int:
    """How many of our wrappers lie around the engine's own method ``name`` (its class's, bound to it)."""
    method, own, depth = getattr(engine, name), getattr(type(engine), name).__get__(engine), 0
    while method != own:
        method, depth = method.__wrapped__, depth + 1
    return depth


def _depths(engine: Any) -> dict[str, int]:
    return {name: _depth(engine, name) for name in ADAPTED}


@pytest.fixture
def gemma3() -> Iterator[tuple[LayoutEngine, roundtrip.Request]]:
    """An engine over the gemma3 example (full attention + a window), bound with chunks in parts."""
    layout = materialize(load_layout_spec("gemma3"), seed=3)
    request = roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=3)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, CHUNKS * layout.chunk_size))
    with LayoutEngine(layout, storage, kernel_backend="torch") as engine:
        engine.connector.bind(layout, split=True)
        yield engine, request


def test_every_call_rebuilds_the_chain_from_the_instance_methods(gemma3) -> None:
    engine, _ = gemma3
    lmcache = engine.engine
    assert _depths(lmcache) == {"store": 0, "lookup": 0}
    assert lmcache.retrieve == type(lmcache).retrieve.__get__(lmcache)  # loads go through connector.chunk_loads
    parts, chunk = engine.connector.parts, engine.layout.chunk_size
    adapted = {"store": 1, "lookup": 2}
    for _ in range(2):
        adapt_engine(lmcache, parts, chunk, {"lmcache.tag.t": "a"})
        assert _depths(lmcache) == adapted
    adapt_engine(lmcache)
    assert _depths(lmcache) == {"store": 0, "lookup": 0}


def test_the_last_calls_tags_are_the_ones_lookups_carry(gemma3) -> None:
    """Stored under tags A, a lookup that names no tags hits only while the engine is adapted with A (tags B:
    a miss, which is also the check's negative control)."""
    engine, request = gemma3
    lmcache, parts, chunk = engine.engine, engine.connector.parts, engine.layout.chunk_size
    adapt_engine(lmcache, parts, chunk)
    engine.store(request.tokens, request.store_ids)
    stored = CHUNKS * chunk

    def untagged_lookup() -> int:
        return lmcache.lookup(torch.tensor(request.tokens), request_configs=None)

    hits = []
    for tags in (engine.tags, {tag: "another" for tag in engine.tags}, engine.tags):
        adapt_engine(lmcache, parts, chunk, tags)
        hits.append(untagged_lookup())
    assert hits == [stored, 0, stored]


def test_the_declared_changes_name_every_method_adapt_engine_replaces() -> None:
    declared = {(c.target.rsplit(":", 1)[1], m) for c in INSTANCE_CHANGES for m in c.methods}
    assert {("LMCacheEngine", name) for name in ADAPTED} <= declared
    assert {m for cls, m in declared if cls == "LMCacheMetadata"} == {"get_shapes", "get_dtypes", "get_num_groups"}
