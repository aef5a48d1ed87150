"""``lmcache-platforms bench --engine``: store and load speed inside a real vLLM engine with our connector, per
LMCache storage tier, against a plain copy of the same bytes timed in the same engine process.

A kernel figure is not the user's figure: around the transfer sit LMCache's hashing and allocation, our
connector, the storage backends and vLLM's own threads. Each tier serves the same N-token prompts through
fresh in-process engines (``tools/demo/engine_pass``, cores pinned as the demo pins them). A cold pass stores
them; the local CPU tier then serves them again in the same engine with vLLM's prefix cache off, so every hit
is LMCache's; every other tier serves them from a fresh engine whose CPU cache is empty, so every hit is read
from that tier. A request's speed is our connector's exact byte count for it over the cost the lines of
``connector.chunk_stores`` and ``chunk_loads`` report for its store and load. The ``vllm`` pseudo-tier is what a
hit is worth without LMCache: vLLM's own prefix cache answering each prompt a second time in one engine.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from lmcache_platforms.tools import checksum_cost
from lmcache_platforms.tools.demo.model import MODELS, ModelSpec, ensure_model, with_context
from lmcache_platforms.tools.demo.runners import PassRunner, Resources
from lmcache_platforms.tools.demo.scenario import BLOCK_SIZE, OUR_CONNECTOR, connector_config
from lmcache_platforms.tools.demo.workload import Request, warmup_request
from lmcache_platforms.tools.redis_server import RedisCluster, RedisServer

GIB = 2**30
# Not an LMCache tier: vLLM alone, its own prefix cache on, the hit every tier's warm TTFT is compared with.
VLLM_HIT = "vllm"
TIERS = ("cpu", "disk", "fs", "redis", "redis-cluster", VLLM_HIT)
# The Redis tiers: a private store of each kind, started for the tier and stopped after it.
REDIS_STORES = {"redis": RedisServer, "redis-cluster": RedisCluster}
MODES = ("paged", "layerwise")
# Each store's and load's cost in ms comes from the line of connector/chunk_stores.py or chunk_loads.py; bytes
# come from our connector's line for the request, logged after every call for it.
CALL_COST = {
    "store": re.compile(r"stored \d+ objects \([^)]*\) for \d+ of \d+ tokens, \d+ bytes written, ([\d.]+) ms"),
    "load": re.compile(r"read \d+ objects \([^)]*\) for \d+ of \d+ tokens, \d+ bytes written, ([\d.]+) ms"),
}
OURS = {
    "store": re.compile(r"stored tokens \[(\d+), (\d+)\) in LMCache, (\d+) bytes written"),
    "load": re.compile(r"loaded tokens \[(\d+), (\d+)\) from LMCache, (\d+) bytes read"),
}


@dataclass(frozen=True)
class EngineBench:
    """What to run: the model, the prompt length and count, chunk size, tiers, resources."""

    model: ModelSpec
    tokens: int
    requests: int
    chunk_size: int
    tiers: tuple[str, ...]
    workdir: Path
    resources: Resources = field(default_factory=Resources.available)
    timeout_s: float = 900.0
    modes: tuple[str, ...] = ("paged",)
    kv_events: bool = False
    checksum_cost: bool = False  # tools/checksum_cost: the checksum's own cost, call by call
    idle_steps: int = 0  # tools/step_cost: decode this many tokens after the cold pass, the connector timed


@dataclass
class Transfers:
    """Per request of one pass: tokens and bytes from our line, seconds from LMCache's lines."""

    tokens: list[int] = field(default_factory=list)
    bytes: list[float] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    @property
    def gbps(self) -> float | None:
        return sum(self.bytes) / sum(self.seconds) / 1e9 if self.seconds and sum(self.seconds) > 0 else None


def parse_lines(log: str, kind: str, skip: int = 0) -> Transfers:
    """Each request's ``kind`` (store, load): tokens and bytes from our line, seconds summed over the calls'
    lines (``CALL_COST``) since the previous one of ours; the first ``skip`` requests left out."""
    events = sorted([(m.start(), "cost", m) for m in CALL_COST[kind].finditer(log)]
                    + [(m.start(), "ours", m) for m in OURS[kind].finditer(log)], key=lambda event: event[0])
    found, seconds = Transfers(), 0.0
    for _, what, match in events:
        if what == "cost":
            seconds += float(match.group(1)) / 1e3
            continue
        found.tokens.append(int(match.group(2)) - int(match.group(1)))
        found.bytes.append(float(match.group(3)))
        found.seconds.append(seconds)
        seconds = 0.0
    return Transfers(found.tokens[skip:], found.bytes[skip:], found.seconds[skip:])


def kv_bytes_per_token(model: ModelSpec) -> int:
    """K and V of every layer, bf16: what one token stores when every chunk is stored whole."""
    return model.num_layers * 2 * model.num_kv_heads * model.head_dim * 2


def lmcache_yaml(tier: str, chunk_size: int, cpu_gib: float, store_gib: float, store: str) -> str:
    """LMCache's config for one tier: the local CPU cache always (LMCache allocates from it), plus the tier."""
    lines = [f"chunk_size: {chunk_size}", "local_cpu: true", f"max_local_cpu_size: {cpu_gib:.3f}"]
    if tier == "disk":
        lines += [f'local_disk: "{store}/"', f"max_local_disk_size: {store_gib:.3f}"]
    elif tier == "fs":
        lines += [f'remote_url: "fs://localhost:0{store}"', "remote_serde: naive"]
    elif tier in REDIS_STORES:
        lines += [f'remote_url: "{store}"', "remote_serde: naive"]
    return "\n".join(lines) + "\n"


def prompts(bench: EngineBench) -> list[Request]:
    """``bench.requests`` distinct prompts of ``bench.tokens`` tokens, the same for every tier."""
    return [Request(f"prompt-{i}", warmup_request(bench.tokens, bench.model.vocab_size, f"bench-{i}").tokens)
            for i in range(bench.requests)]


def _asked_again(served: list[Request]) -> list[Request]:
    """The same prompts a second time, in one engine (named apart for its log)."""
    return [Request(f"{r.name}-again", r.tokens) for r in served]


def _spec(bench: EngineBench, model_dir: Path, served: list[Request], salt: str, memcpy_bytes: int) -> dict[str, Any]:
    return {
        "model_dir": str(model_dir), "block_size": BLOCK_SIZE, "max_model_len": bench.model.max_model_len,
        "max_tokens": 1, "logprobs": 0, "kv_transfer_config": connector_config(OUR_CONNECTOR),
        "warmup": vars(warmup_request(bench.tokens, bench.model.vocab_size, salt)),
        "requests": [vars(r) for r in served], "enable_prefix_caching": False, "memcpy_bytes": memcpy_bytes,
        # An ipc:// endpoint: vLLM's publisher binds it (a tcp:// one naming a host it would connect to).
        "kv_events_endpoint": f"ipc://{bench.workdir.resolve()}/{salt}-events" if bench.kv_events else None,
        "checksum_cost": bench.checksum_cost,
        "idle_steps": bench.idle_steps,
        # Shorter than a chunk: the connector has nothing to store, and no hit to load.
        "idle_prompt": warmup_request(min(32, bench.chunk_size - 1), bench.model.vocab_size, f"{salt}-idle").tokens,
    }


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _settled(router: Any, prompts: list[list[int]], quiet_s: float = 1.0) -> list[int]:
    """The leading tokens of each prompt a router following a pass's KV events (``--kv-events``) holds, once they
    stopped changing for ``quiet_s`` (the pass has ended; its last events may still be in flight): the row shows
    that the events it was timed with were really published."""
    seen = [router.cached_tokens("pass", tokens) for tokens in prompts]
    while True:
        time.sleep(quiet_s)
        now = [router.cached_tokens("pass", tokens) for tokens in prompts]
        if now == seen:
            return now
        seen = now


def _follow_events(spec: dict[str, Any]) -> contextlib.AbstractContextManager[Any]:
    """A router (``tools/kv_router.py``) following the pass's events while it runs; ``None`` without events."""
    if not spec["kv_events_endpoint"]:
        return contextlib.nullcontext()
    from lmcache_platforms.tools.kv_router import KVRouter

    return contextlib.closing(KVRouter({"pass": spec["kv_events_endpoint"]}))


def run_tier(bench: EngineBench, tier: str, model_dir: Path, runner: PassRunner, store: str,
             mode: str = "paged") -> dict[str, Any]:
    """One tier in one mode: a cold pass stores the prompts, then they are loaded from the tier.

    LMCache's local disk index lives in its process, so the disk tier loads in the engine that stored, its CPU
    cache sized for about one prompt: by the time a prompt comes again it is on disk only. The CPU tier loads
    in the same engine too; fs and Redis load in a fresh engine, whose CPU cache is empty.
    """
    served = prompts(bench)
    per_request = kv_bytes_per_token(bench.model) * bench.tokens
    store_gib = 2.5 * (bench.requests + 1) * per_request / GIB
    cpu_gib = (1.5 * per_request + 2**26) / GIB if tier == "disk" else max(0.5, store_gib)
    config = bench.workdir / f"{tier}.yaml"
    config.write_text(lmcache_yaml(tier, bench.chunk_size, cpu_gib, store_gib, store))
    env = {"LMCACHE_CONFIG_FILE": str(config), "LMCACHE_USE_LAYERWISE": str(mode == "layerwise")}
    same_engine = tier in ("cpu", "disk")
    again = _asked_again(served) if same_engine else []
    cold_spec = _spec(bench, model_dir, served + again, f"{tier}-cold", per_request)
    with _follow_events(cold_spec) as router:
        cold = runner.run(f"{tier}-cold", cold_spec, env)
        published = _settled(router, [r.tokens for r in served]) if router else None
    cold_log = runner.logs[-1].read_text()
    stored = parse_lines(cold_log, "store", skip=1)
    if same_engine:
        stored = Transfers(stored.tokens[:len(served)], stored.bytes[:len(served)], stored.seconds[:len(served)])
        warm, loaded = cold["requests"][len(served):], parse_lines(cold_log, "load")
        memcpy_s, loading = cold["memcpy_s"], cold
    else:
        loading = runner.run(f"{tier}-warm", _spec(bench, model_dir, served, f"{tier}-warm", per_request), env)
        warm, memcpy_s = loading["requests"], loading["memcpy_s"]
        loaded = parse_lines(runner.logs[-1].read_text(), "load")
    memcpy_gbps = per_request / memcpy_s / 1e9
    costs = {}
    if bench.checksum_cost:  # over every store and load of the pass, the warm-up's included, as the totals are
        costs = {**checksum_cost.cost(cold["checksum_cost"], "store", parse_lines(cold_log, "store").seconds),
                 **checksum_cost.cost(loading["checksum_cost"], "load", loaded.seconds)}
    return {
        "tier": tier,
        "mode": mode,
        "memcpy_GBps": memcpy_gbps,
        "store_GBps": stored.gbps,
        "store_x_memcpy": stored.gbps / memcpy_gbps if stored.gbps else None,
        "load_GBps": loaded.gbps,
        "load_x_memcpy": loaded.gbps / memcpy_gbps if loaded.gbps else None,
        "stored_bytes_per_request": _median(stored.bytes),
        "read_bytes_per_request": _median(loaded.bytes),
        "store_ms": _median([s * 1e3 for s in stored.seconds]),
        "load_ms": _median([s * 1e3 for s in loaded.seconds]),
        "cold_ttft_s": _median([r["ttft_s"] for r in cold["requests"][:len(served)]]),
        "warm_ttft_s": _median([r["ttft_s"] for r in warm]),
        "hit_tokens": [r["lmcache_hit_tokens"] for r in warm],
        "published_tokens": published,
        "rss_after_warmup_MiB": loading.get("rss_after_warmup_mib"),
        "rss_growth_MiB": _growth(loading),
        **_terms(warm),
        **costs,
        **cold.get("idle", {}),
    }


def _terms(warm: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where the warm TTFT went, medians over the warm requests: waiting to be scheduled (the connector's lookup
    in it) and from scheduled to the first token (the load in it, beside ``load_ms``); with the connector timed
    (``--idle-steps``), the scheduler's lookup (``get_num_new_matched_tokens``, a round trip to the worker) and
    all the connector's calls of the request."""
    terms = {"warm_queued_ms": _median([r["queued_s"] * 1e3 for r in warm if r["queued_s"] is not None]),
             "warm_prefill_ms": _median([r["prefill_s"] * 1e3 for r in warm if r["prefill_s"] is not None])}
    timed = [r["connector"]["seconds"] for r in warm if "connector" in r]
    if timed:
        terms["warm_lookup_ms"] = _median([t.get("get_num_new_matched_tokens", 0.0) * 1e3 for t in timed])
        terms["warm_connector_ms"] = _median([sum(t.values()) * 1e3 for t in timed])
    return terms


def run_vllm_hit(bench: EngineBench, model_dir: Path, runner: PassRunner) -> dict[str, Any]:
    """vLLM without a connector, its own prefix cache on: each prompt asked twice in one engine, the second time
    a hit of vLLM's own (all but the last token), the warm TTFT a tier's is compared with
    (``warm_ttft_x_vllm_hit``)."""
    served = prompts(bench)
    spec = {**_spec(bench, model_dir, served + _asked_again(served), VLLM_HIT, 0), "kv_transfer_config": None,
            "enable_prefix_caching": True, "kv_events_endpoint": None, "idle_steps": 0}
    result = runner.run(VLLM_HIT, spec, {})
    warm = result["requests"][len(served):]
    return {
        "tier": VLLM_HIT,
        "mode": "prefix cache",
        "cold_ttft_s": _median([r["ttft_s"] for r in result["requests"][:len(served)]]),
        "warm_ttft_s": _median([r["ttft_s"] for r in warm]),
        "hit_tokens": [r["vllm_hit_tokens"] for r in warm],
        **_terms(warm),
    }


def add_vllm_hit_ratio(rows: list[dict[str, Any]]) -> None:
    """On every tier's row, its warm TTFT over vLLM's own prefix-cache hit's, where both were measured."""
    baseline = next((row for row in rows if row["tier"] == VLLM_HIT and row.get("warm_ttft_s")), None)
    if baseline is None:
        return
    for row in rows:
        if row["tier"] != VLLM_HIT and row.get("warm_ttft_s") is not None:
            row["warm_ttft_x_vllm_hit"] = row["warm_ttft_s"] / baseline["warm_ttft_s"]


def _growth(result: dict[str, Any]) -> float | None:
    """How far the loading pass's measured requests raised its resident memory above what it held after the
    warm-up (engine, model, a prefill of the longest prompt): LMCache's objects in its CPU tier and every
    buffer of a request's store and load."""
    peak, base = result.get("peak_rss_requests_mib"), result.get("rss_after_warmup_mib")
    return None if peak is None or base is None else peak - base


def _row_or_error(tier: str, mode: str, measure: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """``measure()``'s row, or the row naming its error: one tier's failure is a result, not the end of the bench."""
    try:
        return measure()
    except Exception as exc:  # noqa: BLE001 - reported in the tier's row
        return {"tier": tier, "mode": mode, "error": f"{type(exc).__name__}: {exc}"}


def _run_on_store(bench: EngineBench, tier: str, mode: str, model_dir: Path, runner: PassRunner,
                  store: Path) -> dict[str, Any]:
    """``run_tier`` on ``store``: a private Redis store of the tier's kind kept there, or the folder itself."""
    if tier in REDIS_STORES:
        with REDIS_STORES[tier](str(store)) as server:
            row = run_tier(bench, tier, model_dir, runner, server.url, mode)
            if tier == "redis" and mode == "paged":
                row.update(read_floor(server.url, runner.logs[-1].read_text()))
            return row
    return run_tier(bench, tier, model_dir, runner, str(store.resolve()), mode)


def read_floor(url: str, warm_log: str) -> dict[str, Any]:
    """``read_floor_ms``: the objects one request of the warm pass read, read again from the store alone in one
    pipeline (``tools/remote_floor``), and ``read_floor_bytes`` their bytes; an error in ``read_floor_error``."""
    from lmcache_platforms.tools.remote_floor import objects_read, read_ms

    try:
        ms, nbytes = read_ms(url, objects_read(warm_log))
    except Exception as exc:  # noqa: BLE001 - a missing floor must not cost the tier's row
        return {"read_floor_error": f"{type(exc).__name__}: {exc}"}
    return {"read_floor_ms": ms, "read_floor_bytes": nbytes}


def run_bench(bench: EngineBench, progress: Callable[[str], None]) -> dict[str, Any]:
    """Every tier of ``bench``; a tier that fails is reported with its error, the others still run."""
    model_dir = ensure_model(bench.model, None, progress)
    bench.workdir.mkdir(parents=True, exist_ok=True)
    runner = PassRunner(bench.workdir, bench.resources, progress, bench.timeout_s)
    results: list[dict[str, Any]] = []
    for tier in bench.tiers:
        if tier == VLLM_HIT:
            progress(f"vLLM's own prefix cache: {bench.requests} prompts of {bench.tokens} tokens, each twice")
            results.append(_row_or_error(tier, "prefix cache", partial(run_vllm_hit, bench, model_dir, runner)))
            continue
        for mode in bench.modes:
            store = bench.workdir / f"{tier}-store"
            shutil.rmtree(store, ignore_errors=True)
            store.mkdir(parents=True)
            progress(f"tier {tier}, {mode}: {bench.requests} prompts of {bench.tokens} tokens")
            try:
                results.append(_row_or_error(tier, mode, partial(_run_on_store, bench, tier, mode, model_dir,
                                                                 runner, store)))
            finally:
                shutil.rmtree(store, ignore_errors=True)
        add_load_hidden(results[-len(bench.modes):])
    add_vllm_hit_ratio(results)
    return {"model": bench.model.name, "tokens": bench.tokens, "requests": bench.requests,
            "chunk_size": bench.chunk_size, "kv_events": bench.kv_events, "cores": bench.resources.cpu_list(),
            "tiers": results}


def add_load_hidden(rows: list[dict[str, Any]]) -> None:
    """On a tier's layerwise row, the part of the paged load its warm TTFT hid (see the module's docstring)."""
    by_mode = {row["mode"]: row for row in rows if "error" not in row}
    paged, layerwise = by_mode.get("paged"), by_mode.get("layerwise")
    if paged is None or layerwise is None or not paged["load_ms"] or paged["warm_ttft_s"] is None:
        return
    load_s = paged["load_ms"] / 1e3
    forward_s = paged["warm_ttft_s"] - load_s
    layerwise["load_hidden"] = 1 - (layerwise["warm_ttft_s"] - forward_s) / load_s


def bench_from_args(args: argparse.Namespace, workdir: Path) -> EngineBench:
    """The EngineBench ``bench --engine`` asked for: the model's context grows to fit ``--tokens``; another
    ``--full-attention-every`` makes a variant with as many KV bytes per token and another number of groups."""
    model = MODELS[args.model]
    if args.full_attention_every is not None:
        every = args.full_attention_every
        if not 1 <= every <= model.num_layers:
            raise ValueError(f"--full-attention-every must be 1 to {model.num_layers}, got {every}")
        model = replace(model, name=f"{model.name}-full{every}", full_attention_every=every)
    model = with_context(model, args.tokens + 1)
    tiers = tuple(t.strip() for t in args.tiers.split(",") if t.strip())
    unknown = sorted(set(tiers) - set(TIERS))
    if unknown or not tiers:
        raise ValueError(f"--tiers takes a comma list of {', '.join(TIERS)}, got {args.tiers!r}")
    modes = tuple(m.strip() for m in args.modes.split(",") if m.strip())
    if not modes or sorted(set(modes) - set(MODES)) or len(set(modes)) != len(modes):
        raise ValueError(f"--modes takes a comma list of {', '.join(MODES)} (each once), got {args.modes!r}")
    if args.idle_steps < 0:
        raise ValueError(f"--idle-steps takes a token count, 0 or more, got {args.idle_steps}")
    per_request = kv_bytes_per_token(model) * args.tokens
    resources = Resources.available()
    kv_gib = max(resources.kv_cache_gib, -(-2 * per_request // GIB))
    return EngineBench(model, args.tokens, args.requests, args.chunk_size, tiers, workdir,
                       replace(resources, kv_cache_gib=kv_gib), modes=modes, kv_events=args.kv_events,
                       checksum_cost=args.checksum_cost, idle_steps=args.idle_steps)
