"""The scheduler side's KV events from the workers' reports, on real vLLM requests (their block hashes computed by
vLLM's own block hasher): what every tensor-parallel worker reported is published once per tier, with exactly the
request's hash blocks inside the stored prefix, its extra keys (cache salt) and parent; what only some workers
reported, a request vLLM no longer knows or a prefix already published is not; a reset is ``AllBlocksCleared``;
a stored chunk a local tier dropped is ``BlockRemoved`` for exactly its hash blocks, once per tier, even after its
request ended."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
from lmcache.utils import CacheEngineKey
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from lmcache_platforms.connector.parts import PART_TAG
from lmcache_platforms.integration.vllm.kv_events import (
    MAX_TRACKED_CHUNKS,
    EventQueue,
    RemovedChunk,
    StoredPrefix,
    StoredPrefixes,
    Tier,
    chunk_id,
    external_hashes,
    tiers_of,
)
from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG

HASH_BLOCK = 16
CPU, REMOTE, DISK = Tier("CPU", "LOCAL"), Tier("STORAGE", "REMOTE"), Tier("STORAGE", "LOCAL")


def request(req_id: str, tokens: int, salt: str | None = None) -> Request:
    init_none_hash(sha256)
    return Request(req_id, list(range(100, 100 + tokens)), SamplingParams(max_tokens=1), None, cache_salt=salt,
                   block_hasher=get_request_block_hasher(HASH_BLOCK, sha256))


def gathered(*workers: list[StoredPrefix]) -> StoredPrefixes:
    """What vLLM's output aggregator makes of the workers' reports: the first worker's container, then each other
    worker's events added and counted."""
    combined = StoredPrefixes(workers[0])
    for reports in workers[1:]:
        combined.add_events(StoredPrefixes(reports).get_all_events())
        combined.increment_workers(1)
    return combined


def stored(queue: EventQueue) -> list[BlockStored]:
    events = list(queue.take())
    assert all(isinstance(e, BlockStored) for e in events), events
    return [e for e in events if isinstance(e, BlockStored)]


def test_a_prefix_every_worker_stored_is_published_once_per_tier_with_vllms_hashes() -> None:
    req = request("a", 300, salt="tenant-1")
    queue = EventQueue(True, HASH_BLOCK, (CPU, REMOTE))
    queue.stored(gathered([StoredPrefix("a", 0, 256)], [StoredPrefix("a", 0, 256)]), {"a": req})
    events = stored(queue)
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes[:16]]
    assert [(e.medium, e.locality) for e in events] == [("CPU", "LOCAL"), ("STORAGE", "REMOTE")]
    for event in events:
        assert event.block_hashes == hashes
        assert event.parent_block_hash is None
        assert event.token_ids == list(range(100, 356))
        assert (event.block_size, event.group_idx, event.lora_name) == (HASH_BLOCK, None, None)
        assert event.extra_keys == [("tenant-1",), *[None] * 15]  # vLLM salts the first block only
    # The next store of the request goes on from where the last ended; its chunk ends inside a hash block.
    queue.stored(gathered([StoredPrefix("a", 256, 300)]), {"a": req})
    (event, _) = stored(queue)
    assert event.block_hashes == [maybe_convert_block_hash(h) for h in req.block_hashes[16:18]]
    assert event.parent_block_hash == hashes[-1]
    assert event.token_ids == list(range(356, 388))


def test_what_not_every_worker_stored_what_vllm_forgot_and_repeats_are_not_published() -> None:
    req = request("a", 300)
    queue = EventQueue(True, HASH_BLOCK, (CPU,))
    queue.stored(gathered([StoredPrefix("a", 0, 256)], [StoredPrefix("a", 0, 192)]), {"a": req})
    queue.stored(gathered([StoredPrefix("gone", 0, 256)]), {"a": req})
    assert stored(queue) == []
    queue.stored(gathered([StoredPrefix("a", 0, 192)]), {"a": req})
    queue.stored(gathered([StoredPrefix("a", 0, 192)]), {"a": req})
    assert [len(e.block_hashes) for e in stored(queue)] == [12]
    queue.finished("a")
    queue.stored(gathered([StoredPrefix("a", 0, 192)]), {"a": req})
    assert [len(e.block_hashes) for e in stored(queue)] == [12]  # a request id vLLM reused starts afresh


def test_a_reset_is_published_and_switched_off_queues_publish_nothing() -> None:
    req = request("a", 64)
    queue = EventQueue(True, HASH_BLOCK, (CPU,))
    queue.stored(gathered([StoredPrefix("a", 0, 64)]), {"a": req})
    queue.cleared()
    queue.stored(gathered([StoredPrefix("a", 0, 64)]), {"a": req})
    assert [type(e) for e in queue.take()] == [BlockStored, AllBlocksCleared, BlockStored]
    for off in (EventQueue(False, HASH_BLOCK, (CPU,)), EventQueue(True, HASH_BLOCK, ())):
        off.stored(gathered([StoredPrefix("a", 0, 64)]), {"a": req})
        off.cleared()
        assert list(off.take()) == []


def test_tiers_follow_lmcaches_config() -> None:
    class Config:
        local_cpu = True
        local_disk = "file:///tmp/lmcache"
        remote_url = "redis://127.0.0.1:6379"

    assert tiers_of(Config()) == (CPU, DISK, REMOTE)
    Config.local_cpu, Config.local_disk = False, None
    assert tiers_of(Config()) == (REMOTE,)


@pytest.mark.parametrize("as_int", ["1", "0"])
def test_hashes_are_published_as_vllm_converts_them(monkeypatch: pytest.MonkeyPatch, as_int: str) -> None:
    monkeypatch.setenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", as_int)
    hashes = request("a", 64).block_hashes
    assert external_hashes(hashes) == [maybe_convert_block_hash(h) for h in hashes]
    assert external_hashes(hashes) != [maybe_convert_block_hash(h) for h in reversed(hashes)]  # the oracle sees order


def test_the_reports_container_keeps_what_every_worker_reported() -> None:
    """vLLM's ``KVConnectorKVEvents`` contract, as its output aggregator and a connector's own merging use it."""
    both, one = StoredPrefix("a", 0, 64), StoredPrefix("b", 0, 64)
    reports = gathered([both, one], [both])
    assert (reports.get_number_of_workers(), sorted(reports.get_all_events(), key=str)) == (2, [both, both, one])
    assert reports.common() == [both]
    assert reports.aggregate().get_all_events() == [both] and reports.get_number_of_workers() == 1
    reports.clear_events()
    assert (reports.get_all_events(), reports.common()) == ([], [])


def _chunks(*bounds: int) -> tuple[tuple[int, int, tuple[int, tuple[()]]], ...]:
    """Chunks ``[bounds[i], bounds[i + 1])``, each named by its start."""
    return tuple((start, end, (start, ())) for start, end in pairwise(bounds))


def _dropped(chunk_start: int, tier: Tier) -> RemovedChunk:
    return RemovedChunk((chunk_start, ()), tier.medium, tier.locality)


def test_a_chunk_a_local_tier_dropped_is_published_as_removed_once_per_tier_after_its_request_ended() -> None:
    req = request("a", 300)
    queue = EventQueue(True, HASH_BLOCK, (CPU, DISK, REMOTE))
    report = StoredPrefix("a", 0, 296, _chunks(0, 120, 256, 296))
    queue.stored(gathered([report], [report]), {"a": req})
    assert len(stored(queue)) == 3
    queue.finished("a")
    hashes = [maybe_convert_block_hash(h) for h in req.block_hashes]
    # The first worker's CPU cache drops the second chunk: a miss there, whatever the other worker holds.
    queue.stored(gathered([_dropped(120, CPU)], []), {})
    queue.stored(gathered([], [_dropped(120, CPU)]), {})  # the other worker's too: already published
    queue.stored(gathered([_dropped(120, DISK), _dropped(120, REMOTE)]), {})  # the remote tier never drops
    queue.stored(gathered([_dropped(256, CPU), _dropped(999, CPU)]), {})  # a chunk no store reported
    events = list(queue.take())
    assert all(isinstance(e, BlockRemoved) for e in events), events
    assert [(e.block_hashes, e.medium, e.locality) for e in events] == [
        (hashes[7:16], "CPU", "LOCAL"), (hashes[7:16], "STORAGE", "LOCAL"),  # block 7 spans two chunks
        (hashes[16:18], "CPU", "LOCAL")]  # tokens 288-296 are in no whole hash block of the 300
    queue.cleared()
    queue.stored(gathered([_dropped(0, CPU)]), {})
    assert [type(e) for e in queue.take()] == [AllBlocksCleared]


def test_the_oldest_stored_chunks_are_forgotten_first() -> None:
    req = request("a", 32)
    queue = EventQueue(True, HASH_BLOCK, (CPU,))
    reports = [StoredPrefix("a", 0, 32, ((0, 32, (i, ())),)) for i in range(MAX_TRACKED_CHUNKS + 1)]
    queue.stored(gathered(reports), {"a": req})
    queue.stored(gathered([_dropped(0, CPU), _dropped(1, CPU), _dropped(MAX_TRACKED_CHUNKS, CPU)]), {})
    assert [type(e) for e in queue.take()] == [BlockStored, BlockRemoved, BlockRemoved]


def test_a_store_and_a_removal_are_kept_as_vllm_gathers_them() -> None:
    stored_by_both = StoredPrefix("a", 0, 64, _chunks(0, 64))
    dropped_by_one = _dropped(0, CPU)
    reports = gathered([stored_by_both, dropped_by_one], [stored_by_both])
    assert reports.common() == [stored_by_both, dropped_by_one]
    assert reports.aggregate().get_all_events() == [stored_by_both, dropped_by_one]


def test_a_chunk_is_named_alike_by_every_worker_and_part_and_apart_from_another_scope() -> None:
    def key(worker: int, **tags: str) -> CacheEngineKey:
        return CacheEngineKey("m", 2, worker, 7, torch.bfloat16, {"lmcache.tag.lmcp_layout": "L", **tags})

    part = {PART_TAG: "reach64"}
    assert chunk_id(key(0)) == chunk_id(key(1, **part)) == (7, (("lmcp_layout", "L"),))
    assert chunk_id(key(0, **{SCOPE_TAG: "tenant-1"})) != chunk_id(key(0))
