"""KV-aware routing on our events (``tools.kv_router``): two real ``vllm serve`` instances of the Gemma-3-like
hybrid with our connector (vLLM's prefix cache off: every block a router learns of is LMCache's) publish their
stores; the router sends each prompt's follow-up to the server that stored the prompt, where it hits every whole
chunk of it. Negative control: the same follow-up sent to the other server hits nothing."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import FIRST_ORDINARY_TOKEN
from lmcache_platforms.tools.kv_router import KVRouter, PrefixIndex
from tests.serving.test_upstream_names import CHUNK, cpu_tier_env

pytestmark = pytest.mark.slow

BLOCK = 32
LENGTHS = (300, 200, 260, 140)


def prompts() -> list[list[int]]:
    span = TINY_MODEL.vocab_size - FIRST_ORDINARY_TOKEN
    return [[(t * 41 + i * 97) % span + FIRST_ORDINARY_TOKEN for t in range(n)] for i, n in enumerate(LENGTHS)]


def follow_up(tokens: list[int]) -> list[int]:
    """The prompt and 40 tokens more (another turn of the same conversation)."""
    return [*tokens, *(FIRST_ORDINARY_TOKEN + (7 * t) % 50 for t in range(40))]


def ask(server: VllmServer, name: str, tokens: list[int]) -> int:
    (answer,) = run_requests(server.base_url, [(name, text_of(tokens), len(tokens))], Sampling(max_tokens=2))
    return int(answer["lmcache_hit_tokens"])


def test_the_router_sends_a_follow_up_where_its_prefix_was_stored_and_it_hits_there(tmp_path: Path) -> None:
    model = ensure_model(TINY_MODEL)
    servers, endpoints = {}, {}
    for name in ("a", "b"):
        endpoints[name] = f"ipc://{tmp_path}/{name}-events"
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": endpoints[name]}
        servers[name] = VllmServer.for_model(
            model, {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
            [*serve_args(BLOCK, 1024), "--no-enable-prefix-caching", "--kv-events-config", json.dumps(events)],
            tmp_path / f"{name}.log", Resources.available(), cpu_tier_env(tmp_path))
    router = KVRouter(endpoints)
    try:
        with contextlib.ExitStack() as stack:
            for server in servers.values():
                stack.enter_context(server)
            first = {}
            for i, tokens in enumerate(prompts()):
                name, cached = router.route(tokens)
                assert cached == 0
                first[i] = name
                assert ask(servers[name], f"p{i}", tokens) == 0
            assert sorted(first.values()) == ["a", "a", "b", "b"]  # nothing cached anywhere: spread evenly
            whole = [n // CHUNK * CHUNK for n in LENGTHS]
            deadline = time.monotonic() + 60
            while [router.cached_tokens(first[i], t) for i, t in enumerate(prompts())] != whole:
                assert time.monotonic() < deadline, "the stores' events never reached the router"
                time.sleep(0.1)
            for i, tokens in enumerate(prompts()):
                name, cached = router.route(follow_up(tokens))
                assert (name, cached) == (first[i], whole[i])
                assert ask(servers[name], f"p{i}-next", follow_up(tokens)) == whole[i]
            other = "b" if first[0] == "a" else "a"
            assert ask(servers[other], "p0-elsewhere", follow_up(prompts()[0])) == 0
    finally:
        router.close()


def test_the_index_counts_only_a_published_prefix_and_forgets_at_a_reset() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockStored

    tokens = list(range(100))
    index = PrefixIndex()
    index.apply(BlockStored(block_hashes=[1, 2], parent_block_hash=None, token_ids=tokens[:64], block_size=32,
                            lora_id=None, medium="CPU", lora_name=None))
    index.apply(BlockStored(block_hashes=[3], parent_block_hash=2, token_ids=tokens[64:96], block_size=32,
                            lora_id=None, medium="CPU", lora_name=None))
    assert index.cached_tokens(tokens) == 96
    assert index.cached_tokens([*tokens[:32], 999, *tokens[33:]]) == 32  # the second block differs
    assert index.cached_tokens(tokens[32:]) == 0  # a prefix starts at the first block
    index.apply(AllBlocksCleared())
    assert index.cached_tokens(tokens) == 0
