"""Two ``vllm serve`` instances of the Gemma-3-like hybrid with our connector, running at once and sharing one
local 3-master Redis Cluster (LMCache's ``redis-cluster://``; each chunk stored in parts, whose keys the cluster
spreads over its nodes), as replicas behind a load balancer share a store:

1. each server answers a prompt of its own and then one that shares its first four chunks with the other
   server's (both compute and write those chunks' keys at the same time);
2. each answers the other's two prompts: every whole chunk of them is a hit (the other server's stores, read
   from the cluster) and the answers equal the first server's computed ones;
3. a cluster node is restarted (it keeps its slots and loses its keys) and each server answers a prompt the
   other stored before: a hit can only be shorter, never wrong.

Every answer (tokens and raw top-5 logits) equals the one the same server computes for that prompt under a
``cache_salt`` of its own (a salted request never reads another's chunks), and both servers stop cleanly."""

from __future__ import annotations

import contextlib
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import FIRST_ORDINARY_TOKEN
from lmcache_platforms.tools.redis_server import RedisCluster
from tests.ci import missing
from tests.serving.test_upstream_names import CHUNK, cpu_tier_env

pytestmark = pytest.mark.slow

SHARED = 4 * CHUNK  # the shared prefix: four whole chunks
SAMPLING = Sampling(max_tokens=4)


def tokens(seed: int, count: int) -> list[int]:
    span = TINY_MODEL.vocab_size - FIRST_ORDINARY_TOKEN
    return [(t * 43 + seed * 89) % span + FIRST_ORDINARY_TOKEN for t in range(count)]


def prompts() -> dict[str, list[int]]:
    """Per server: its own prompt (5 whole chunks), one sharing the shared prefix (plus one chunk of its own and a
    tail) and one it stores before the node restart."""
    shared = tokens(0, SHARED)
    return {
        "a-own": tokens(1, 5 * CHUNK + 20), "b-own": tokens(2, 5 * CHUNK + 20),
        "a-shared": [*shared, *tokens(3, CHUNK + 30)], "b-shared": [*shared, *tokens(4, CHUNK + 30)],
        "a-late": tokens(5, 4 * CHUNK + 10), "b-late": tokens(6, 4 * CHUNK + 10),
    }


def ask(server: VllmServer, names: list[str], salt: str | None = None) -> list[dict[str, Any]]:
    texts = prompts()
    return run_requests(server.base_url, [(name, text_of(texts[name]), len(texts[name])) for name in names],
                        SAMPLING, extra_body={"cache_salt": salt} if salt else None)


def both(servers: dict[str, VllmServer], names: dict[str, list[str]]) -> dict[str, dict[str, Any]]:
    """Each server answers its names, the two servers at once; the answers by prompt name."""
    with ThreadPoolExecutor(2) as pool:
        done = pool.map(lambda server: ask(servers[server], names[server]), ("a", "b"))
        return {answer["name"]: answer for answers in done for answer in answers}


def answer(result: dict[str, Any]) -> tuple[list[int], list[Any]]:
    return result["tokens"], result["top_logits"]


def test_two_servers_sharing_a_redis_cluster_hit_each_others_chunks_and_answer_as_computed(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing("redis-server or redis-cli is not on PATH (Debian package redis-server)")
    model = ensure_model(TINY_MODEL)
    whole = {name: len(t) // CHUNK * CHUNK for name, t in prompts().items()}
    with RedisCluster(str(tmp_path / "cluster")) as cluster:
        env = cpu_tier_env(tmp_path, f'remote_url: "{cluster.url}"\nremote_serde: naive\n')
        servers = {name: VllmServer.for_model(
            model, {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
            [*serve_args(32, 1024), "--no-enable-prefix-caching"], tmp_path / f"{name}.log", Resources.available(),
            env) for name in ("a", "b")}
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(2) as starting:
            for started in starting.map(stack.enter_context, servers.values()):
                assert started.started_s > 0
            first = both(servers, {"a": ["a-own", "a-shared", "a-late"], "b": ["b-own", "b-shared", "b-late"]})
            crossed = both(servers, {"a": ["b-own", "b-shared"], "b": ["a-own", "a-shared"]})
            cluster.restart(0)
            late = both(servers, {"a": ["b-late"], "b": ["a-late"]})
            references = [{name: ask(servers[server], [name], salt=f"reference-{server}-{name}")[0]
                           for name in prompts()} for server in ("a", "b")]
    for name in ("a-own", "b-own", "a-late", "b-late"):
        assert first[name]["lmcache_hit_tokens"] == 0, name
    # The shared prefix: computed by both at once, or by one while the other already found it stored.
    assert {first[n]["lmcache_hit_tokens"] for n in ("a-shared", "b-shared")} <= {0, SHARED}
    assert {name: r["lmcache_hit_tokens"] for name, r in crossed.items()} == {name: whole[name] for name in crossed}
    for name, result in late.items():
        assert result["lmcache_hit_tokens"] in range(0, whole[name] + 1, CHUNK), (name, result["lmcache_hit_tokens"])
    reference = references[0]
    assert {r["lmcache_hit_tokens"] for refs in references for r in refs.values()} == {0}  # a salt shares nothing
    assert {name: answer(r) for name, r in references[1].items()} == {name: answer(r) for name, r in reference.items()}
    for results in (first, crossed, late):
        for name, result in results.items():
            assert answer(result) == answer(reference[name]), name
    for name, server in servers.items():
        assert (server.exit_code, server.stopped_in_time) == (0, True), (name, server.log_path.read_text()[-3000:])
