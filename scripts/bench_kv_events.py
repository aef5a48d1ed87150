"""What publishing KV events costs the scheduler per stored request: turning one worker report into vLLM's
``BlockStored`` (``kv_events.EventQueue``) for a prompt of N tokens, at vLLM's hash block sizes.

``.venv/bin/python scripts/bench_kv_events.py [--tokens 2048] [--repeats 500]``. The worker's part is one list
append per store, outside LMCache's timed calls; this is the rest, run in the scheduler's step. A benchmark, not a
test: not in ``make test``.
"""

from __future__ import annotations

import argparse
import time

from vllm import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.request import Request

from lmcache_platforms.integration.vllm.kv_events import EventQueue, StoredPrefix, StoredPrefixes, Tier


def per_store_ms(tokens: int, hash_block: int, repeats: int, salt: str | None) -> float:
    """The mean over ``repeats`` reports of the whole prompt, each published afresh."""
    request = Request("bench", list(range(tokens + 1)), SamplingParams(max_tokens=1), None, cache_salt=salt,
                      block_hasher=get_request_block_hasher(hash_block, sha256))
    seconds = 0.0
    for _ in range(repeats):
        queue = EventQueue(True, hash_block, (Tier("CPU", "LOCAL"),))
        started = time.perf_counter()
        queue.stored(StoredPrefixes([StoredPrefix("bench", 0, tokens)]), {"bench": request})
        list(queue.take())
        seconds += time.perf_counter() - started
    return 1e3 * seconds / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=500)
    args = parser.parse_args()
    init_none_hash(sha256)
    for hash_block in (16, 128):
        for salt in (None, "tenant"):
            print(f"{args.tokens} tokens, hash block {hash_block}, {'salted' if salt else 'plain'}: "
                  f"{per_store_ms(args.tokens, hash_block, args.repeats, salt):.3f} ms per store")


if __name__ == "__main__":
    main()
