"""KV events for routers from a real ``vllm serve`` (``--kv-events-config``, vLLM's ZMQ publisher) of a Gemma-3-like
hybrid with our connector: every chunk a request stored in LMCache is published once as ``BlockStored`` (medium
``CPU``, locality ``LOCAL``) with vLLM's own block hashes for those tokens -- the oracle is vLLM's prefix cache on
the same server, which publishes its blocks (medium ``GPU``) with the hashes it computed --; the chunks LMCache's
CPU cache evicts to make room are published as ``BlockRemoved`` with those hashes; and a reset with
``reset_external`` publishes our ``AllBlocksCleared`` beside vLLM's."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from tests.serving.observe import PREFIX, receive, scrape, scrape_by_label
from tests.serving.test_upstream_names import CHUNK, LENGTHS, _requests, cpu_tier_env

pytestmark = pytest.mark.slow

BLOCK = 32
LAYER_BYTES_PER_TOKEN = 2 * 2 * 64 * 2  # K and V x 2 KV heads x 64 dims x bf16
CHUNK_BYTES = 131_072  # the tiny model's chunk object (its "bound layout" line)
ROOM_CHUNKS = 5  # the CPU cache holds 5 of the 7 whole chunks of the two prompts: the second store evicts


def chains(events: list[Any], medium: str) -> list[tuple[list[Any], list[int]]]:
    """The ``BlockStored`` events of one medium with a hash for every block of their tokens as chains of (hashes,
    tokens), each chain one prompt's: an event whose parent is the last hash of a chain continues it. (vLLM's own
    events for a sliding-window group hash only the blocks in the window; its full-attention group's hash every
    block, once per group: repeats are dropped.)"""
    found: list[tuple[list[Any], list[int]]] = []
    seen: set[tuple[Any, ...]] = set()
    for event in events:
        if (not isinstance(event, BlockStored) or event.medium != medium
                or len(event.block_hashes) * event.block_size != len(event.token_ids)):
            continue
        key = (*event.block_hashes, event.parent_block_hash)
        if key in seen:
            continue
        seen.add(key)
        chain = next((c for c in found if event.parent_block_hash is not None and c[0][-1] == event.parent_block_hash),
                     None)
        if chain is None:
            found.append((list(event.block_hashes), list(event.token_ids)))
        else:
            chain[0].extend(event.block_hashes)
            chain[1].extend(event.token_ids)
    return found


def expected_chains(vllm_chains: list[tuple[list[Any], list[int]]], prompts: list[list[int]],
                    block_size: int) -> list[tuple[list[Any], list[int]]]:
    """What our events must publish: for each prompt, vLLM's hashes of the blocks inside its whole chunks."""
    out = []
    for tokens in prompts:
        hashes, seen = next(c for c in vllm_chains if c[1] == tokens[: len(c[1])] and c[1])
        whole = len(tokens) // CHUNK * CHUNK
        assert len(seen) >= whole, (len(seen), whole)
        out.append((hashes[: whole // block_size], tokens[:whole]))
    return out


def removed_oldest_first(removed: list[list[Any]], published: list[tuple[list[Any], list[int]]]) -> bool:
    """Whether ``removed`` names the first chunks of the ``published`` chains (in the order they were stored),
    each by exactly its blocks' hashes, none twice."""
    per_chunk = CHUNK // BLOCK
    chunks = [hashes[i:i + per_chunk] for hashes, _ in published for i in range(0, len(hashes), per_chunk)]
    return removed == chunks[:len(removed)]


def test_a_hybrid_servers_stores_are_published_with_vllms_block_hashes(tmp_path: Path) -> None:
    requests = _requests(TINY_MODEL.vocab_size)
    prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in requests]
    endpoint = f"ipc://{tmp_path}/kv-events"  # the server binds it; nothing listens beyond this machine
    context = zmq.Context()
    subscriber = context.socket(zmq.SUB)
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    subscriber.connect(endpoint)
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoint, "topic": "kv"}
    server = VllmServer.for_model(ensure_model(TINY_MODEL),
                                  {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
                                  [*serve_args(BLOCK, 1024), "--kv-events-config", json.dumps(events_config)],
                                  tmp_path / "server.log", Resources.available(), {
                                      **cpu_tier_env(tmp_path, cpu_gib=(ROOM_CHUNKS + 0.5) * CHUNK_BYTES / 2**30),
                                      "VLLM_SERVER_DEV_MODE": "1"})  # /reset_prefix_cache is a dev route
    try:
        with server:
            cold = run_requests(server.base_url, prompts, Sampling(max_tokens=2))
            ours_done = len(requests)

            def stored_all(events: list[Any]) -> bool:
                return len(chains(events, "CPU")) >= ours_done and sum(
                    len(c[1]) for c in chains(events, "CPU")) >= sum(n // CHUNK * CHUNK for n in LENGTHS) and sum(
                    isinstance(e, BlockRemoved) for e in events) >= 2

            stored = receive(subscriber, stored_all)
            again = run_requests(server.base_url, prompts, Sampling(max_tokens=2))
            request = urllib.request.Request(f"{server.base_url}/reset_prefix_cache?reset_external=true",
                                             method="POST")
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.status == 200
            # Events go out with a step's output: the next request's steps carry the reset's.
            fresh = run_requests(server.base_url, prompts[:1], Sampling(max_tokens=2))
            after = receive(subscriber, lambda events: sum(isinstance(e, AllBlocksCleared) for e in events) >= 2
                            and bool(chains(events, "CPU")))
            resets = scrape(server.base_url)[f"{PREFIX}resets_total"]
            group_bytes = scrape_by_label(server.base_url, "group_bytes_stored_total", "kv_group")
    finally:
        subscriber.close(linger=0)
        context.term()
    assert [r["lmcache_hit_tokens"] for r in cold] == [0, 0]
    assert [r["vllm_hit_tokens"] for r in again] == [n // BLOCK * BLOCK for n in LENGTHS]
    tokens = [r.tokens for r in requests]
    vllm = chains(stored, "GPU")
    ours = chains(stored, "CPU")
    assert ours == expected_chains(vllm, tokens, BLOCK)
    ours_events = [e for e in stored if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert {(e.block_size, e.locality, e.group_idx) for e in ours_events} == {(BLOCK, "LOCAL", None)}
    # The second prompt's store made room by evicting the least recently used objects, the first prompt's: each
    # chunk that lost one (its parts are objects of their own, of other sizes) is published once, in the order
    # they were stored, with the hashes of its blocks; at least the two chunks' worth that did not fit.
    removed = [e for e in stored if isinstance(e, BlockRemoved)]
    assert {(e.medium, e.locality) for e in removed} == {("CPU", "LOCAL")}
    assert 2 <= len(removed) < sum(len(hashes) for hashes, _ in ours) // (CHUNK // BLOCK)
    assert removed_oldest_first([e.block_hashes for e in removed], ours)
    # The repeat hit vLLM's own cache and stored nothing new (else it would be in ``after``, ahead of the reset);
    # the reset cleared vLLM's blocks and LMCache's (one of the two is vLLM's: without ours, a time-out); the
    # first prompt after it hit nothing and was stored and published anew, after the clearing.
    assert [(r["vllm_hit_tokens"], r["lmcache_hit_tokens"]) for r in fresh] == [(0, 0)]
    assert resets == 1  # and on /metrics
    # Four KV-cache groups of one layer each (full attention, then three sliding-window layers whose 64-token
    # window spans a chunk): each stored its rows of the 7 chunks, then of the 4 stored again after the reset.
    assert group_bytes == {str(group): 11 * CHUNK * LAYER_BYTES_PER_TOKEN for group in range(4)}
    kinds = [type(e).__name__ for e in after if not isinstance(e, BlockStored) or e.medium == "CPU"]
    assert kinds == ["AllBlocksCleared", "AllBlocksCleared", "BlockStored"], kinds
    assert chains(after, "CPU") == ours[:1]


def test_the_event_oracle_catches_a_wrong_hash_and_a_shifted_prompt() -> None:
    """Negative control of the comparison above, on vLLM-shaped chains."""
    tokens = list(range(300))
    vllm_chain = ([f"h{i}" for i in range(9)], tokens[:288])
    good = [([f"h{i}" for i in range(8)], tokens[:256])]
    assert expected_chains([vllm_chain], [tokens], BLOCK) == good
    wrong_hash = [([*good[0][0][:-1], "x"], good[0][1])]
    shifted = [([*good[0][0][1:], "h8"], tokens[32:288])]
    for planted in (wrong_hash, shifted):
        assert planted != expected_chains([vllm_chain], [tokens], BLOCK)


def test_the_removal_oracle_catches_a_shifted_a_repeated_and_a_skipped_chunk() -> None:
    """Negative control of ``removed_oldest_first``."""
    published = [([f"h{i}" for i in range(8)], list(range(256)))]
    assert removed_oldest_first([["h0", "h1"], ["h2", "h3"]], published)
    for planted in ([["h1", "h2"]], [["h0", "h1"], ["h0", "h1"]], [["h2", "h3"]], [["h0"]]):
        assert not removed_oldest_first(planted, published)
