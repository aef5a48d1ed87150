"""What a real LMCache engine's tiers do reaches the listeners of ``connector.tier_watch``: what its local CPU
cache evicts (the KV events publish it as ``BlockRemoved``), exactly the keys of the chunks it dropped, the least
recently used first; and what a load read from which tier (the statistics count it), exactly the objects' bytes.
LMCache 0.5.6 alone tells nobody. A listener that raises fails neither LMCache's work nor the other listeners."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lmcache_platforms import ensure_patched
from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.connector.tier_watch import listen
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions
from lmcache_platforms.tools.fixtures import materialize
from tests.upstream_originals import put_back

pytestmark = pytest.mark.slow

CHUNKS = 2


@dataclass
class Heard:
    dropped: list[Any]
    """The keys the CPU cache dropped."""
    reads: list[tuple[str, int]]
    """(tier, bytes) of each read of a load."""
    first_keys: list[Any]
    hits: tuple[int, int]
    """The tokens each request hits after both were stored."""
    loaded: int
    tokens: int
    object_bytes: int


def _fail(*news: Any) -> None:
    raise RuntimeError(f"planted: {news}")


def _run() -> Heard:
    """Two requests of ``CHUNKS`` chunks each through a CPU cache that holds ``CHUNKS`` chunks, then a load of the
    second."""
    ensure_patched()  # as activation does in vLLM; this test builds LMCache without vLLM's plugin loader
    layout = materialize(load_layout_spec("gemma3"), "bundled", seed=3)
    first, second = (roundtrip.make_request(layout, CHUNKS * layout.chunk_size, seed=seed) for seed in (1, 2))
    object_bytes = paged_format(layout).nbytes
    room = (CHUNKS * object_bytes + object_bytes // 2) / 2**30
    dropped: list[Any] = []
    reads: list[tuple[str, int]] = []
    with LayoutEngine(layout, StorageOptions(max_local_cpu_size=room)) as engine:
        manager = engine.engine.storage_manager
        for target in (manager.storage_backends["LocalCPUBackend"], manager):
            listen(target, "broken", _fail)  # a listener that raises loses its own notice, nothing else
        listen(manager.storage_backends["LocalCPUBackend"], "test", dropped.append)
        listen(manager, "test", lambda tier, objects: reads.append(
            (tier, sum(o.get_size() for o in objects if o is not None))))
        engine.store(first.tokens, first.store_ids)
        engine.store(second.tokens, second.store_ids)
        hits = engine.lookup(first.tokens), engine.lookup(second.tokens)
        first_keys = [key for _, _, key in engine.engine.token_database.process_tokens(
            tokens=torch.tensor(first.tokens), request_configs=engine.tags)]
        heard_before_load = list(dropped)
        loaded = engine.retrieve(second.tokens, second.load_ids)
        return Heard(heard_before_load, list(reads), first_keys, hits, loaded, len(first.tokens), object_bytes)


def test_an_evicting_cpu_cache_names_every_chunk_it_dropped_and_a_load_its_tier_and_bytes() -> None:
    heard = _run()
    assert heard.hits == (0, heard.tokens) and heard.loaded == heard.tokens
    assert len(heard.first_keys) == CHUNKS
    assert heard.dropped == heard.first_keys
    assert heard.reads == [("LocalCPUBackend", CHUNKS * heard.object_bytes)]


@pytest.mark.parametrize("patched", ["LocalCPUBackend.remove", "StorageManager.batched_get"])
def test_without_the_patch_nothing_is_heard(monkeypatch: pytest.MonkeyPatch, patched: str) -> None:
    """Negative control: LMCache's own method back; the same eviction and load happen and nothing is heard."""
    ensure_patched()
    assert len(put_back(monkeypatch, lambda patch: patch.target.endswith(patched))) == 1
    heard = _run()
    assert heard.hits == (0, heard.tokens) and heard.loaded == heard.tokens
    assert (heard.dropped == [], heard.reads == []) == (patched.endswith("remove"), patched.endswith("batched_get"))
