"""Our connector on a data-parallel ``vllm serve`` (two engines, two API server processes), watched as a fleet is:
its statistics on ``/metrics`` and its KV events. Each prompt goes to its own engine (vLLM's
``X-data-parallel-rank`` header), cold then warm (vLLM's prefix cache off, so the repeats load from LMCache):

- the counters are exact, summed over the engines and per engine: lookups, hit tokens, chunks and bytes stored
  and loaded (bytes = chunks x the chunk object's bytes: the model's layout, then the checksum trailer's column;
  per KV-cache group, the group's own bytes; per tier, the objects read from it), one load and store time
  observed per request; nothing is counted as a failed load (vLLM hands each step's statistics to one API server
  and sums their samples);
- each engine's publisher (``--kv-events-config``; rank r binds the endpoint's port + r, its replay socket the
  replay endpoint's port + r) has sent one ``BlockStored`` for its prompt's whole chunks, marked with its rank,
  with the block hashes vLLM computes. The test asks each rank's replay socket for everything it published, so
  it does not depend on when a subscription reaches the publisher.

Both engines' hits also show that the worker of rank 1 has a working LMCache (before our device fix it started
in LMCache's degraded mode and recomputed everything)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_events import BlockStored
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.request import Request

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_DENSE_MODEL, ensure_model
from lmcache_platforms.tools.demo.runners import Resources, free_port_run
from lmcache_platforms.tools.demo.server import IN_CORE_WORKER, VllmServer
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from tests.serving.observe import PREFIX, replayed, scrape, scrape_by_label
from tests.serving.test_upstream_names import CHUNK, LENGTHS, _requests, cpu_tier_env

pytestmark = pytest.mark.slow

# The dense tiny model: 4 layers x (K, V) x 2 KV heads x 64 dims x bf16, per token.
BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2
BLOCK = 32


def vllm_block_hashes(tokens: list[int]) -> list[Any]:
    """The block hashes vLLM's scheduler computes for ``tokens`` (its default sha256, no salt), as its own KV
    events carry them."""
    init_none_hash(sha256)
    request = Request("hashes", tokens, SamplingParams(max_tokens=1), None,
                      block_hasher=get_request_block_hasher(BLOCK, sha256))
    return [maybe_convert_block_hash(h) for h in request.block_hashes]


def test_metrics_and_events_of_a_data_parallel_server_are_exact(tmp_path: Path) -> None:
    requests = _requests(TINY_DENSE_MODEL.vocab_size)
    prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in requests]
    port = free_port_run(4)  # two ranks' publishers, then their replay sockets
    # vLLM's publisher binds only wildcard and ipc endpoints, and gives data-parallel ranks their own only on tcp.
    events_config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}",
                     "replay_endpoint": f"tcp://*:{port + 2}", "topic": "kv"}
    # Each engine has one rank: its worker runs inside its engine core, as on a GPU (``IN_CORE_WORKER``).
    server = VllmServer.for_model(ensure_model(TINY_DENSE_MODEL),
                                  {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
                                  [*serve_args(BLOCK, 1024), "--no-enable-prefix-caching", "--api-server-count", "2",
                                   "--data-parallel-size", "2", *IN_CORE_WORKER,
                                   "--kv-events-config", json.dumps(events_config)],
                                  tmp_path / "server.log", Resources.available(),
                                  {**cpu_tier_env(tmp_path), "VLLM_CPU_OMP_THREADS_BIND": "0|1"})
    with server:
        before = scrape(server.base_url)
        cold, warm = ([run_requests(server.base_url, [prompt], Sampling(max_tokens=8),
                                    {"X-data-parallel-rank": str(rank)})[0]
                       for rank, prompt in enumerate(prompts)] for _ in range(2))
        after = scrape(server.base_url)
        per_group = {direction: scrape_by_label(server.base_url, f"group_bytes_{direction}_total", "kv_group")
                     for direction in ("stored", "loaded")}
        per_tier = scrape_by_label(server.base_url, "tier_bytes_read_total", "tier")
        per_engine = scrape_by_label(server.base_url, "chunks_stored_total", "engine")
        # Every step of both passes has run: each rank's replay, once its events have left the publisher's queue.
        published = [replayed(f"tcp://127.0.0.1:{port + 2 + rank}", lambda batches: any(b.events for b in batches))
                     for rank in range(2)]
    hits = [n // CHUNK * CHUNK for n in LENGTHS]  # whole chunks; vLLM computes the last token itself
    assert [r["lmcache_hit_tokens"] for r in cold + warm] == [0, 0, *hits]
    chunks = sum(n // CHUNK for n in LENGTHS)  # only whole chunks are saved (LMCache's save_unfull_chunk: false)
    # Each chunk object: its KV, then the checksum trailer padded to one more uint8 "token" column.
    chunk_bytes = CHUNK * BYTES_PER_TOKEN + CHUNK
    assert set(before.values()) == {0.0}, before
    assert {name.removeprefix(PREFIX): value for name, value in after.items()} == {
        "lookups_total": 4, "hit_tokens_total": sum(hits),
        "chunks_stored_total": chunks, "bytes_stored_total": chunks * chunk_bytes,
        "chunks_loaded_total": chunks, "bytes_loaded_total": chunks * chunk_bytes,
        "group_bytes_stored_total": chunks * CHUNK * BYTES_PER_TOKEN,
        "group_bytes_loaded_total": chunks * CHUNK * BYTES_PER_TOKEN,
        "tier_bytes_read_total": chunks * chunk_bytes,
        "loads_failed_total": 0, "resets_total": 0,
        "remote_lookups_timed_out_total": 0, "remote_lookups_skipped_total": 0,
        "store_seconds_count": 2, "load_seconds_count": 2,
        "store_seconds_sum": after[f"{PREFIX}store_seconds_sum"],
        "load_seconds_sum": after[f"{PREFIX}load_seconds_sum"],
    }
    assert 0 < after[f"{PREFIX}store_seconds_sum"] < 10 and 0 < after[f"{PREFIX}load_seconds_sum"] < 10
    # One KV-cache group: its bytes are the chunks' KV, without the trailer's column.
    kv_bytes = chunks * CHUNK * BYTES_PER_TOKEN
    assert per_group == {"stored": {"0": kv_bytes}, "loaded": {"0": kv_bytes}}
    assert per_tier == {"LocalCPUBackend": chunks * chunk_bytes}  # the only tier: every object read from it
    assert per_engine == {str(rank): n // CHUNK for rank, n in enumerate(LENGTHS)}
    for rank, (batches, tokens) in enumerate(zip(published, (r.tokens for r in requests), strict=True)):
        whole = len(tokens) // CHUNK * CHUNK
        events = [(b.data_parallel_rank, e) for b in batches for e in b.events]
        blocks = whole // BLOCK
        assert events == [(rank, BlockStored(block_hashes=vllm_block_hashes(tokens)[:blocks], parent_block_hash=None,
                                             token_ids=tokens[:whole], block_size=BLOCK, lora_id=None, medium="CPU",
                                             lora_name=None, extra_keys=[None] * blocks, locality="LOCAL"))], rank


def test_the_hash_oracle_tells_prompts_apart() -> None:
    """Negative control of ``vllm_block_hashes``: a prompt that differs in one token, or starts one token later,
    has other hashes from that block on."""
    tokens = list(range(100, 100 + 4 * BLOCK))
    one_token = [*tokens[:BLOCK + 3], tokens[BLOCK + 3] + 1, *tokens[BLOCK + 4:]]
    hashes = vllm_block_hashes(tokens)
    assert len(hashes) == 4
    assert vllm_block_hashes(one_token)[0] == hashes[0]
    assert not set(vllm_block_hashes(one_token)[1:]) & set(hashes)
    assert not set(vllm_block_hashes([*tokens[1:], 7])) & set(hashes)
