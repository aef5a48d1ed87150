"""Scale-out across servers sharing one store: 1, 2, ... ``vllm serve`` instances with our connector on one local
3-master Redis Cluster, driven by a streaming OpenAI client with a shared-prefix workload (``bench --servers``).

The workload is ``groups`` prefixes of ``prefix_tokens`` each, asked in ``rounds`` rounds with a new suffix every
time. In round r, group g goes to server (g + r) mod N, so from round 1 on a group usually reaches a server that
has not seen its prefix: a hit there can only come from another server's stores in the cluster (a cross-server
hit). Each server answers its share of a round with ``concurrency`` requests in flight (one after another at 1),
the servers at once; the next round starts when all are done. A request's hit tokens are the server's own count
for it (``--enable-prompt-tokens-details``: vLLM's prefix cache and LMCache together); on a server that had not
seen the prefix only LMCache can hold it, as no two prefixes share a token. Every N starts from an empty cluster
and fresh servers with vLLM's defaults (its prefix cache on).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import ModelSpec
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import FIRST_ORDINARY_TOKEN
from lmcache_platforms.tools.engine_bench import lmcache_yaml
from lmcache_platforms.tools.redis_server import RedisCluster

SUFFIX_TOKENS = 128
MAX_TOKENS = 16
ANSWERED_TOKENS = SUFFIX_TOKENS + MAX_TOKENS
"""What a prompt holds besides its prefix, with its answer: the context a server needs beyond ``prefix_tokens``."""
BLOCK_SIZE = 32


@dataclass(frozen=True)
class ScaleBench:
    """What ``bench --servers`` runs."""

    model: ModelSpec
    model_dir: Path
    servers: tuple[int, ...]
    prefix_tokens: int
    groups: int
    rounds: int
    chunk_size: int
    workdir: Path
    concurrency: int = 1


@dataclass(frozen=True)
class Ask:
    """One request of the workload: its round, server, prefix group and whether the server saw the group before."""

    round: int
    server: int
    group: int
    seen: bool


def schedule(groups: int, rounds: int, servers: int) -> list[list[Ask]]:
    """Per round, the requests in the order each server answers its share."""
    seen: set[tuple[int, int]] = set()
    out = []
    for r in range(rounds):
        asks = []
        for g in range(groups):
            server = (g + r) % servers
            asks.append(Ask(r, server, g, (server, g) in seen))
            seen.add((server, g))
        out.append(asks)
    return out


def prompt(group: int, round_: int, prefix_tokens: int, vocab: int) -> list[int]:
    """The group's prefix and a suffix of the round's own (no two prompts share more than their prefix)."""
    span = vocab - FIRST_ORDINARY_TOKEN
    prefix = [(t * 31 + group * 977) % span + FIRST_ORDINARY_TOKEN for t in range(prefix_tokens)]
    suffix = [(t * 53 + (group * 7919 + round_ * 104729) % span) % span + FIRST_ORDINARY_TOKEN
              for t in range(SUFFIX_TOKENS)]
    return prefix + suffix


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with at least ``fraction`` of the values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def summary(servers: int, answered: list[tuple[Ask, dict[str, Any] | None]], warm_seconds: float,
            prompt_tokens: int) -> dict[str, Any]:
    """One row of the scaling table: the warm rounds' (1 on) aggregate requests/s, TTFT percentiles and hit
    rates (vLLM's own prefix cache and LMCache together; and the hits on servers that had not seen the prefix,
    which only LMCache can give), and the failed requests of every round."""
    warm = [(ask, result) for ask, result in answered if ask.round > 0 and result is not None]
    errors = sum(result is None for _, result in answered)
    ttfts = [result["ttft_s"] for _, result in warm]
    hits = sum(result["cached_tokens"] for _, result in warm)
    cross = sum(result["cached_tokens"] for ask, result in warm if not ask.seen)
    tokens = prompt_tokens * len(warm)
    return {
        "servers": servers, "warm_requests": len(warm), "errors": errors,
        "requests_per_s": len(warm) / warm_seconds if warm_seconds > 0 else None,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p99_s": percentile(ttfts, 0.99) if ttfts else None,
        "hit_rate": hits / tokens if tokens else None,
        "cross_server_hit_rate": cross / tokens if tokens else None,
    }


def run_servers(bench: ScaleBench, servers: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """The workload on ``servers`` fresh servers and an empty cluster; one row of the table."""
    folder = bench.workdir / f"servers-{servers}"
    folder.mkdir(parents=True, exist_ok=True)
    sampling = Sampling(max_tokens=MAX_TOKENS)
    plan = schedule(bench.groups, bench.rounds, servers)
    answered: list[tuple[Ask, dict[str, Any] | None]] = []
    warm_seconds = 0.0
    with RedisCluster(str(folder / "cluster")) as cluster:
        config = folder / "lmcache.yaml"
        config.write_text(lmcache_yaml("redis-cluster", bench.chunk_size, 1.0, 0.0, cluster.url))
        transfer = {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"}
        args = [*serve_args(BLOCK_SIZE, bench.model.max_model_len), "--enable-prompt-tokens-details"]
        started = [VllmServer.for_model(bench.model_dir, transfer, args, folder / f"server-{index}.log",
                                        Resources.available(), {"LMCACHE_CONFIG_FILE": str(config)})
                   for index in range(servers)]
        with contextlib.ExitStack() as stack, ThreadPoolExecutor(servers * bench.concurrency) as pool:
            list(pool.map(stack.enter_context, started))
            progress(f"{servers} server(s) up")
            for asks in plan:
                def lane(index: int, mine: list[Ask]) -> list[tuple[Ask, dict[str, Any] | None]]:
                    """One of a server's ``concurrency`` clients, each sending its requests one after another."""
                    texts = [prompt(a.group, a.round, bench.prefix_tokens, bench.model.vocab_size) for a in mine]
                    try:
                        results = run_requests(started[index].base_url,
                                               [(f"g{a.group}-r{a.round}", text_of(t), len(t))
                                                for a, t in zip(mine, texts, strict=True)], sampling, count_hits=False)
                    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not raised
                        progress(f"server {index}: {exc}")
                        return [(a, None) for a in mine]
                    return list(zip(mine, results, strict=True))

                lanes = []
                for index in range(servers):
                    mine = [ask for ask in asks if ask.server == index]
                    lanes += [(index, mine[k::bench.concurrency]) for k in range(min(bench.concurrency, len(mine)))]
                began = time.perf_counter()
                for pairs in pool.map(lambda work: lane(*work), lanes):
                    answered.extend(pairs)
                if asks[0].round > 0:
                    warm_seconds += time.perf_counter() - began
                progress(f"{servers} server(s): round {asks[0].round} done")
    return summary(servers, answered, warm_seconds, bench.prefix_tokens + SUFFIX_TOKENS)


def run_scale(bench: ScaleBench, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every server count of the bench, one after another."""
    rows = [run_servers(bench, servers, progress) for servers in bench.servers]
    return {"model": bench.model.name, "prefix_tokens": bench.prefix_tokens, "suffix_tokens": SUFFIX_TOKENS,
            "groups": bench.groups, "rounds": bench.rounds, "chunk_size": bench.chunk_size,
            "concurrency": bench.concurrency,
            "cores": len(Resources.available().cores), "rows": rows}

