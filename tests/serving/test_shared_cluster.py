"""Three ``vllm serve`` instances of the Gemma-3-like hybrid with our connector, running at once and sharing one
local 3-master Redis Cluster (LMCache's ``redis-cluster://``; each chunk stored in parts, whose keys the cluster
spreads over its nodes), as replicas behind a load balancer share a store:

1. each server answers a prompt of its own and then one that shares its first four chunks with the others'
   (all three compute and write those chunks' keys at the same time);
2. each answers the two other servers' first two prompts: every whole chunk of them is a hit (the other
   servers' stores, read from the cluster) and the answers equal the first server's computed ones;
3. a cluster node is restarted (it keeps its slots and loses its keys) and each server answers a prompt the
   next one stored before: a hit can only be shorter, never wrong;
4. one server is killed (SIGKILL, its whole process group) as soon as it logs the first object of a prompt's
   store, with the rest of the store's writes in flight; the two others answer that prompt: whatever they find
   whole may be a hit, nothing half-written is loaded, and they serve on.

Every answer (tokens and raw top-5 logits) equals the one the same server computes for that prompt under a
``cache_salt`` of its own (a salted request never reads another's chunks), and the servers left stop cleanly."""

from __future__ import annotations

import contextlib
import os
import re
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
SERVERS = ("a", "b", "c")
STORES = re.compile(r": stored \d+ objects \(")  # the line of each store (connector/chunk_stores.py)


def tokens(seed: int, count: int) -> list[int]:
    span = TINY_MODEL.vocab_size - FIRST_ORDINARY_TOKEN
    return [(t * 43 + seed * 89) % span + FIRST_ORDINARY_TOKEN for t in range(count)]


def prompts() -> dict[str, list[int]]:
    """Per server: its own prompt (5 whole chunks), one sharing the shared prefix (plus one chunk of its own and a
    tail) and one it stores before the node restart; and the prompt whose store the kill interrupts."""
    shared = tokens(0, SHARED)
    out = {}
    for index, server in enumerate(SERVERS):
        seed = 1 + 3 * index
        out[f"{server}-own"] = tokens(seed, 5 * CHUNK + 20)
        out[f"{server}-shared"] = [*shared, *tokens(seed + 1, CHUNK + 30)]
        out[f"{server}-late"] = tokens(seed + 2, 4 * CHUNK + 10)
    out["a-killed"] = tokens(3 * len(SERVERS) + 1, 8 * CHUNK + 10)
    return out


def ask(server: VllmServer, names: list[str], salt: str | None = None) -> list[dict[str, Any]]:
    texts = prompts()
    return run_requests(server.base_url, [(name, text_of(texts[name]), len(texts[name])) for name in names],
                        SAMPLING, extra_body={"cache_salt": salt} if salt else None)


def at_once(servers: dict[str, VllmServer], names: dict[str, list[str]],
            salt: bool = False) -> dict[tuple[str, str], dict[str, Any]]:
    """Each server named in ``names`` answers its prompts (under a salt of its own per prompt, if ``salt``), the
    servers at once; the answers by (server, prompt name)."""
    def answers(server: str) -> list[tuple[tuple[str, str], dict[str, Any]]]:
        if salt:
            return [((server, name), ask(servers[server], [name], f"reference-{server}-{name}")[0])
                    for name in names[server]]
        return [((server, r["name"]), r) for r in ask(servers[server], names[server])]

    with ThreadPoolExecutor(len(names)) as pool:
        return dict(pair for pairs in pool.map(answers, names) for pair in pairs)


def killed_while_storing(server: VllmServer, name: str, timeout_s: float = 120.0) -> None:
    """Send ``name`` to ``server`` and SIGKILL the server's process group the moment its log shows the
    prompt's store (``chunk_stores``: its objects' writes are then queued or on the wire)."""
    stored_before = len(STORES.findall(server.log_path.read_text(errors="replace")))
    with ThreadPoolExecutor(1) as pool:
        asking = pool.submit(ask, server, [name])
        deadline = time.monotonic() + timeout_s
        while len(STORES.findall(server.log_path.read_text(errors="replace"))) == stored_before:
            assert time.monotonic() < deadline and not asking.done(), "the server never stored the prompt"
            time.sleep(0.002)
        assert server.process is not None
        os.killpg(server.process.pid, signal.SIGKILL)
        # The answer may have left before the kill (LMCache logs a store when it queues the write, and the one
        # output token goes out in the same step); either way the prompt's objects were still being written.
        with contextlib.suppress(Exception):
            asking.result(timeout=60)


def answer(result: dict[str, Any]) -> tuple[list[int], list[Any]]:
    return result["tokens"], result["top_logits"]


def test_three_servers_sharing_a_redis_cluster_hit_each_others_chunks_and_answer_as_computed(
        tmp_path: Path) -> None:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing("redis-server or redis-cli is not on PATH (Debian package redis-server)")
    model = ensure_model(TINY_MODEL)
    whole = {name: len(t) // CHUNK * CHUNK for name, t in prompts().items()}
    following = dict(zip(SERVERS, SERVERS[1:] + SERVERS[:1], strict=True))
    with RedisCluster(str(tmp_path / "cluster")) as cluster:
        env = cpu_tier_env(tmp_path, f'remote_url: "{cluster.url}"\nremote_serde: naive\n')
        servers = {name: VllmServer.for_model(
            model, {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
            [*serve_args(32, 1024), "--no-enable-prefix-caching", "--enable-prompt-tokens-details"],
            tmp_path / f"{name}.log", Resources.available(), env) for name in SERVERS}
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(SERVERS)) as starting:
            for started in starting.map(stack.enter_context, servers.values()):
                assert started.started_s > 0
            first = at_once(servers, {s: [f"{s}-own", f"{s}-shared", f"{s}-late"] for s in SERVERS})
            crossed = at_once(servers, {s: [f"{o}-{kind}" for o in SERVERS if o != s for kind in ("own", "shared")]
                                        for s in SERVERS})
            cluster.restart(0)
            late = at_once(servers, {s: [f"{following[s]}-late"] for s in SERVERS})
            references = at_once(servers, {s: list(prompts()) for s in SERVERS}, salt=True)
            killed_while_storing(servers["a"], "a-killed")
            after_kill = at_once(servers, {s: ["a-killed"] for s in SERVERS if s != "a"})
    for server in SERVERS:
        for name in (f"{server}-own", f"{server}-late"):
            assert first[server, name]["lmcache_hit_tokens"] == 0, name
    # The shared prefix: computed by several at once, or by one while another had stored some or all of its
    # chunks.
    assert {first[s, f"{s}-shared"]["lmcache_hit_tokens"] for s in SERVERS} <= set(range(0, SHARED + 1, CHUNK))
    assert {key: r["lmcache_hit_tokens"] for key, r in crossed.items()} == {key: whole[key[1]] for key in crossed}
    for (_, name), result in late.items():
        assert result["lmcache_hit_tokens"] in range(0, whole[name] + 1, CHUNK), (name, result["lmcache_hit_tokens"])
    assert {r["lmcache_hit_tokens"] for r in references.values()} == {0}  # a salt shares nothing
    # Each server's own count of a request's cached tokens (what `bench --servers` reads, with several requests
    # in flight) equals the hit counters read around it.
    for results in (first, crossed, late, references):
        for key, result in results.items():
            assert result["cached_tokens"] == result["lmcache_hit_tokens"] + result["vllm_hit_tokens"], key
    reference = {name: answer(r) for (server, name), r in references.items() if server == "a"}
    assert {key: answer(r) for key, r in references.items()} == {(s, n): reference[n] for s, n in references}
    for results in (first, crossed, late, after_kill):
        for (server, name), result in results.items():
            assert answer(result) == reference[name], (server, name)
    for result in after_kill.values():
        assert result["lmcache_hit_tokens"] in range(0, whole["a-killed"] + 1, CHUNK), result
    assert servers["a"].exit_code == -signal.SIGKILL
    for name in SERVERS[1:]:
        left = servers[name]
        assert (left.exit_code, left.stopped_in_time) == (0, True), left.log_path.read_text()[-3000:]
