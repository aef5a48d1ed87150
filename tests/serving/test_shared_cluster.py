"""Two ``vllm serve`` instances of the Gemma-3-like hybrid with our connector, running at once and sharing one
local 3-master Redis Cluster (LMCache's ``redis-cluster://``; each chunk stored in parts, whose keys the cluster
spreads over its nodes), as replicas behind a load balancer share a store:

1. each server answers a prompt of its own and then one that shares its first four chunks with the other
   server's (both compute and write those chunks' keys at the same time);
2. each answers the other's two prompts: every whole chunk of them is a hit (the other server's stores, read
   from the cluster) and the answers equal the first server's computed ones;
3. a cluster node is restarted (it keeps its slots and loses its keys) and each server answers a prompt the
   other stored before: a hit can only be shorter, never wrong;
4. one server is killed (SIGKILL, its whole process group) as soon as it logs the first object of a prompt's
   store, with the rest of the store's writes in flight; the other answers that prompt: whatever it finds whole
   may be a hit, nothing half-written is loaded, and it serves on.

Every answer (tokens and raw top-5 logits) equals the one the same server computes for that prompt under a
``cache_salt`` of its own (a salted request never reads another's chunks), and the server left stops cleanly."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
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
    tail) and one it stores before the node restart; and the prompt whose store the kill interrupts."""
    shared = tokens(0, SHARED)
    return {
        "a-own": tokens(1, 5 * CHUNK + 20), "b-own": tokens(2, 5 * CHUNK + 20),
        "a-shared": [*shared, *tokens(3, CHUNK + 30)], "b-shared": [*shared, *tokens(4, CHUNK + 30)],
        "a-late": tokens(5, 4 * CHUNK + 10), "b-late": tokens(6, 4 * CHUNK + 10),
        "a-killed": tokens(7, 8 * CHUNK + 10),
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


def killed_while_storing(server: VllmServer, name: str, timeout_s: float = 120.0) -> None:
    """Send ``name`` to ``server`` and SIGKILL the server's process group the moment its log shows LMCache
    storing that prompt's first object (the other objects' writes are then queued or on the wire)."""
    stored_before = server.log_path.read_text(errors="replace").count(" Stored ")
    with ThreadPoolExecutor(1) as pool:
        asking = pool.submit(ask, server, [name])
        deadline = time.monotonic() + timeout_s
        while server.log_path.read_text(errors="replace").count(" Stored ") == stored_before:
            assert time.monotonic() < deadline and not asking.done(), "the server never stored the prompt"
            time.sleep(0.002)
        assert server.process is not None
        os.killpg(server.process.pid, signal.SIGKILL)
        with pytest.raises(Exception):  # noqa: B017 - the connection drops, however the client reports it
            asking.result(timeout=60)


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
            killed_while_storing(servers["a"], "a-killed")
            (after_kill,) = ask(servers["b"], ["a-killed"])
    for name in ("a-own", "b-own", "a-late", "b-late"):
        assert first[name]["lmcache_hit_tokens"] == 0, name
    # The shared prefix: computed by both at once, or by one while the other had stored some or all of its chunks.
    assert {first[n]["lmcache_hit_tokens"] for n in ("a-shared", "b-shared")} <= set(range(0, SHARED + 1, CHUNK))
    assert {name: r["lmcache_hit_tokens"] for name, r in crossed.items()} == {name: whole[name] for name in crossed}
    for name, result in late.items():
        assert result["lmcache_hit_tokens"] in range(0, whole[name] + 1, CHUNK), (name, result["lmcache_hit_tokens"])
    reference = references[0]
    assert {r["lmcache_hit_tokens"] for refs in references for r in refs.values()} == {0}  # a salt shares nothing
    assert {name: answer(r) for name, r in references[1].items()} == {name: answer(r) for name, r in reference.items()}
    for results in (first, crossed, late, {"a-killed": after_kill}):
        for name, result in results.items():
            assert answer(result) == answer(reference[name]), name
    assert after_kill["lmcache_hit_tokens"] in range(0, whole["a-killed"] + 1, CHUNK), after_kill
    assert servers["a"].exit_code == -signal.SIGKILL
    left = servers["b"]
    assert (left.exit_code, left.stopped_in_time) == (0, True), left.log_path.read_text()[-3000:]
