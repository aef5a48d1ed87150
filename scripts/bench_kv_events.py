"""What publishing KV events costs per stored request, for a prompt of N tokens at vLLM's hash block sizes: the
scheduler turning one worker report into vLLM's ``BlockStored`` and remembering its chunks for a later
``BlockRemoved`` (``kv_events.EventQueue``), and the worker naming the chunks it stored (LMCache's own chunk
hashes, ``kv_events.chunk_id``).

``.venv/bin/python scripts/bench_kv_events.py [--tokens 2048] [--chunk 256] [--repeats 500]``. Both run outside
LMCache's timed store and load calls (the worker's after its store, the scheduler's in its step). A benchmark,
not a test: not in ``make test``.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from lmcache_platforms.integration.vllm.kv_events import (
    ChunkId,
    EventQueue,
    StoredPrefix,
    StoredPrefixes,
    Tier,
    chunk_id,
)
from lmcache_platforms.tools.engine import StorageOptions, engine_config


def token_database(chunk: int) -> Any:
    """LMCache's chunk hasher as an in-process engine builds it (its default hash)."""
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.token_database import ChunkedTokenDatabase

    metadata = LMCacheMetadata(model_name="bench", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                               kv_dtype=torch.uint8, kv_shape=(1, 2, chunk, 1, 1), chunk_size=chunk)
    return ChunkedTokenDatabase(engine_config(chunk, StorageOptions()), metadata)


def worker_ms(tokens: int, chunk: int, repeats: int) -> tuple[float, tuple[tuple[int, int, ChunkId], ...]]:
    """The mean time to name a store's chunks, and the names."""
    database = token_database(chunk)
    ids = list(range(1, tokens + 1))  # a list of ints, as the worker's request metadata holds them
    mask = torch.ones(tokens, dtype=torch.bool)
    tags = {"lmcache.tag.lmcp_layout": "bench"}
    chunks: tuple[tuple[int, int, ChunkId], ...] = ()
    started = time.perf_counter()
    for _ in range(repeats):
        chunks = tuple((first, last, chunk_id(key)) for first, last, key in
                       database.process_tokens(tokens=ids, mask=mask, request_configs=tags))
    return 1e3 * (time.perf_counter() - started) / repeats, chunks


def scheduler_ms(tokens: int, hash_block: int, repeats: int, salt: str | None,
                 chunks: tuple[tuple[int, int, ChunkId], ...]) -> float:
    """The mean over ``repeats`` reports of the whole prompt, each published afresh."""
    request = Request("bench", list(range(tokens + 1)), SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=get_request_block_hasher(hash_block, sha256))
    seconds = 0.0
    for _ in range(repeats):
        queue = EventQueue(True, hash_block, (Tier("CPU", "LOCAL"),))
        started = time.perf_counter()
        queue.stored(StoredPrefixes([StoredPrefix("bench", 0, tokens, chunks)]), {"bench": request})
        list(queue.take())
        seconds += time.perf_counter() - started
    return 1e3 * seconds / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    init_none_hash(sha256)
    named, chunks = worker_ms(args.tokens, args.chunk, args.repeats)
    print(f"{args.tokens} tokens, {len(chunks)} chunks: the worker names them in {named:.3f} ms per store")
    for hash_block in (16, 128):
        for salt in (None, "tenant"):
            print(f"{args.tokens} tokens, hash block {hash_block}, {'salted' if salt else 'plain'}: the scheduler "
                  f"takes {scheduler_ms(args.tokens, hash_block, args.repeats, salt, chunks):.3f} ms per store "
                  f"({scheduler_ms(args.tokens, hash_block, args.repeats, salt, ()):.3f} ms without remembering "
                  "the chunks for BlockRemoved)")


if __name__ == "__main__":
    main()
