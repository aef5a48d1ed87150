"""The scheduler side's KV events from the workers' reports, on real vLLM requests (their block hashes computed by
vLLM's own block hasher): what every tensor-parallel worker reported is published once per tier, with exactly the
request's hash blocks inside the stored prefix, its extra keys (cache salt) and parent; what only some workers
reported, a request vLLM no longer knows or a prefix already published is not; a reset is ``AllBlocksCleared``."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from lmcache_platforms.integration.vllm.kv_events import (
    EventQueue,
    StoredPrefix,
    StoredPrefixes,
    Tier,
    external_hashes,
    tiers_of,
)

HASH_BLOCK = 16
CPU, REMOTE = Tier("CPU", "LOCAL"), Tier("STORAGE", "REMOTE")


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

    assert tiers_of(Config()) == (CPU, Tier("STORAGE", "LOCAL"), REMOTE)
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
