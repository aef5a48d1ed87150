"""A soak run: several streaming clients against ``vllm serve`` with our connector for a bounded time, on a
workload of full hits, partial hits and misses, with an LMCache CPU budget so small that eviction never stops.

What it checks, and why each is measured where it is:
  - no request fails (the client sees every stream to its end);
  - a sample of the answers equals a server without a connector (same prompts, sent one by one afterwards):
    tokens identical, or parting only at a proven bf16 tie (``identity.compare``: the clients' concurrent
    batches cannot be the reference's, so a pick tied to one bf16 step may differ), and top-k raw logits within
    ``MAX_LOGIT_DRIFT_BF16_STEPS``; a planted difference (the
    first chunk of a sampled prompt replaced) must be flagged, or the comparison proves nothing;
  - LMCache's pinned memory objects are back to zero once the clients stop: read from LMCache's own metrics
    endpoint in the worker process (its internal API server, enabled for the run), after its stats logger's
    10-second interval has passed, so the value is one taken after the last request;
  - the worker's resident memory (``/proc/PID/status`` ``VmRSS``) grows no more, once eviction is running,
    than the worker of the server without a connector does under the same requests.

vLLM's own prefix cache is off (``--no-enable-prefix-caching``), so every shared prefix is LMCache's to serve,
and per-request hits come from the usage's ``cached_tokens`` (``--enable-prompt-tokens-details``). Loopback
only; every loop is bounded by a request count and a deadline.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from lmcache_platforms.tools.demo.client import choice_tokens, served_model
from lmcache_platforms.tools.demo.identity import compare
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.report import MAX_LOGIT_DRIFT_BF16_STEPS
from lmcache_platforms.tools.demo.runners import Resources, free_port_run, status_kib
from lmcache_platforms.tools.demo.scenario import BLOCK_SIZE, OUR_CONNECTOR, TOP_LOGITS
from lmcache_platforms.tools.demo.server import VllmServer, http_get, require_vllm_command
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import FIRST_ORDINARY_TOKEN

Progress = Callable[[str], None]
KINDS = ("full", "partial", "miss")
# LMCache's stats logger refreshes its gauges every 10 s (LMCacheEngineBuilder's log_interval).
STATS_INTERVAL_S = 10.0
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")
LMCACHE_GAUGES = {
    "pinned": "lmcache:pinned_memory_objs_count",
    "active": "lmcache:active_memory_objs_count",
    "forced_unpins": "lmcache:forced_unpin_count_total",
    "evictions": "lmcache:local_cpu_evict_count_total",
}


@dataclass(frozen=True)
class SoakOptions:
    """Sizes of one run. ``cpu_budget_gb``: LMCache's ``max_local_cpu_size`` (a tiny-model chunk is 128 KiB,
    so 0.004 holds about 30 of the ~40 chunks the documents alone need)."""

    duration_s: float = 300.0
    clients: int = 4
    max_requests: int = 5000
    documents: int = 10
    document_chunks: int = 4
    chunk_size: int = 64
    max_tokens: int = 8
    cpu_budget_gb: float = 0.004
    sample: int = 9
    seed: int = 11
    workdir: Path = Path(".")
    cache_dir: Path | None = None
    request_timeout_s: float = 120.0
    start_timeout_s: float = 600.0
    rss_interval_s: float = 1.0
    resources: Resources = field(default_factory=Resources.available)


@dataclass(frozen=True)
class SoakRequest:
    index: int
    kind: str
    tokens: list[int]
    reusable: int  # tokens of whole chunks LMCache may hold from an earlier request


def _random_tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, TINY_MODEL.vocab_size) for _ in range(count)]


def documents_of(options: SoakOptions) -> list[list[int]]:
    """The shared documents: whole chunks plus a fixed 16-token question (less than a chunk: never stored)."""
    rng = random.Random(f"soak-documents:{options.seed}")
    length = options.document_chunks * options.chunk_size
    return [_random_tokens(rng, length + 16) for _ in range(options.documents)]


def soak_request(options: SoakOptions, documents: list[list[int]], index: int) -> SoakRequest:
    """Request ``index``: 40% a document with its fixed question (a full hit once stored), 40% a document's
    first chunks with a new tail (a partial hit), 20% new tokens only (a miss); the same for every run."""
    rng = random.Random(f"soak:{options.seed}:{index}")
    draw, document = rng.random(), rng.choice(documents)
    whole = options.document_chunks * options.chunk_size
    if draw < 0.4:
        return SoakRequest(index, "full", document, whole)
    if draw < 0.8:
        kept = rng.randint(1, options.document_chunks - 1) * options.chunk_size
        tail = _random_tokens(rng, rng.randint(options.chunk_size, 2 * options.chunk_size + 32))
        return SoakRequest(index, "partial", document[:kept] + tail, kept)
    fresh = _random_tokens(rng, rng.randint(3 * options.chunk_size, 6 * options.chunk_size))
    return SoakRequest(index, "miss", fresh, 0)


def lmcache_yaml(options: SoakOptions, api_port: int) -> str:
    """LMCache's config: local CPU only, the small budget, its metrics endpoint on (loopback)."""
    return (
        f"chunk_size: {options.chunk_size}\n"
        "local_cpu: true\n"
        f"max_local_cpu_size: {options.cpu_budget_gb}\n"
        "internal_api_server_enabled: true\n"
        "internal_api_server_host: 127.0.0.1\n"
        f"internal_api_server_port_start: {api_port}\n"
    )


def soak_serve_args(max_model_len: int) -> list[str]:
    """The demo's server arguments, with vLLM's prefix cache off and cached tokens reported per request."""
    return [*serve_args(BLOCK_SIZE, max_model_len), "--no-enable-prefix-caching", "--enable-prompt-tokens-details"]


def metric_values(text: str, names: dict[str, str]) -> dict[str, float]:
    """Sums of Prometheus samples named in ``names`` (label sets added up), keyed as ``names``."""
    values = dict.fromkeys(names, 0.0)
    wanted = {metric: key for key, metric in names.items()}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match["name"] in wanted:
            values[wanted[match["name"]]] += float(match["value"])
    return values


def _titled(group: int, title: bytes) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) == group and title in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except (OSError, ProcessLookupError):
            continue
    return sorted(found)


def worker_pids(group: int) -> list[int]:
    """The processes of a server's process group that run vLLM's workers: those titled ``VLLM::Worker``
    (a multiprocess executor), else the engine core (``VLLM::EngineCore``), which runs a one-process executor's
    worker itself."""
    return _titled(group, b"Worker") or _titled(group, b"EngineCore")


def rss_bytes(pid: int) -> int:
    kib = status_kib("VmRSS", pid)
    if kib is None:
        raise RuntimeError(f"no VmRSS for process {pid}")
    return kib * 1024


class RssSampler:
    """Samples one process's RSS every ``interval_s`` on a thread, as (seconds since start, bytes)."""

    def __init__(self, pid: int, interval_s: float) -> None:
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, daemon=True, name="soak-rss")

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(OSError, RuntimeError):
                self.samples.append((time.monotonic() - self._started, rss_bytes(self.pid)))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def at(self, seconds: float) -> int:
        """The first sample taken at or after ``seconds`` (the last one if none)."""
        return next((rss for t, rss in self.samples if t >= seconds), self.samples[-1][1])


def stream_one(client: Any, model: str, tokens: list[int], max_tokens: int) -> dict[str, Any]:
    """One streaming completion: generated tokens, top-k raw logits per token, cached (LMCache) prompt tokens."""
    started = time.perf_counter()
    ttft: float | None = None
    out: dict[str, Any] = {"tokens": [], "top_logits": [], "cached_tokens": None}
    stream = client.completions.create(
        model=model, prompt=text_of(tokens), max_tokens=max_tokens, temperature=0.0, seed=0, logprobs=TOP_LOGITS,
        stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            if chunk.usage.prompt_tokens != len(tokens):
                raise AssertionError(f"the server counted {chunk.usage.prompt_tokens} prompt tokens, not "
                                     f"{len(tokens)}")
            details = chunk.usage.prompt_tokens_details
            out["cached_tokens"] = details.cached_tokens if details is not None else None
        for choice in chunk.choices:
            got = choice_tokens(choice)
            if got is None:
                continue
            if ttft is None:
                ttft = time.perf_counter() - started
            out["tokens"] += got[0]
            out["top_logits"] += got[1]
    if len(out["tokens"]) != max_tokens:
        raise AssertionError(f"stream ended after {len(out['tokens'])} of {max_tokens} tokens")
    out.update(ttft_s=ttft, latency_s=time.perf_counter() - started)
    return out


@contextlib.contextmanager
def openai_client(base_url: str, timeout_s: float) -> Iterator[tuple[Any, str]]:
    from openai import OpenAI

    with OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=timeout_s) as client:
        yield client, served_model(client)


@contextlib.contextmanager
def started(servers: list[VllmServer]) -> Iterator[list[VllmServer]]:
    """Start ``servers`` at the same time (their start-up dominates a short run) and stop them all at the end."""
    with contextlib.ExitStack() as stack, ThreadPoolExecutor(len(servers)) as pool:
        futures = [pool.submit(server.__enter__) for server in servers]
        for server in servers:
            stack.callback(server.__exit__, None, None, None)
        for future in futures:
            future.result()
        yield servers


@dataclass
class Outcome:
    request: SoakRequest
    result: dict[str, Any] | None = None
    error: str | None = None


def run_clients(base_url: str, options: SoakOptions, documents: list[list[int]],
                progress: Progress) -> list[Outcome]:
    """``options.clients`` threads, each sending the next request until the deadline or the request cap."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = iter(range(options.max_requests))
    deadline = time.monotonic() + options.duration_s

    import httpx
    from openai import OpenAIError

    def client_loop() -> None:
        with openai_client(base_url, options.request_timeout_s) as (client, model):
            while time.monotonic() < deadline:
                with lock:
                    index = next(counter, None)
                if index is None:
                    return
                outcome = Outcome(soak_request(options, documents, index))
                try:
                    outcome.result = stream_one(client, model, outcome.request.tokens, options.max_tokens)
                except (OpenAIError, httpx.HTTPError, OSError, AssertionError, ValueError) as exc:
                    outcome.error = f"{type(exc).__name__}: {exc}"
                with lock:
                    outcomes.append(outcome)
                    if len(outcomes) % 50 == 0:
                        progress(f"  {len(outcomes)} requests done")

    threads = [threading.Thread(target=client_loop, name=f"soak-client-{i}") for i in range(options.clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=options.duration_s + options.request_timeout_s + 60)
    return sorted(outcomes, key=lambda o: o.request.index)


def pick_sample(outcomes: list[Outcome], size: int) -> list[Outcome]:
    """Up to ``size`` answered requests, spread over the run and over the kinds, hits preferred (they exercise
    loaded KV)."""
    picked: list[Outcome] = []
    for kind in KINDS:
        done = [o for o in outcomes if o.result is not None and o.request.kind == kind]
        hits = [o for o in done if o.result and o.result["cached_tokens"]]
        per_kind = size // len(KINDS)
        step = max(1, len(hits) // max(1, per_kind))
        chosen = hits[::step][:per_kind]
        picked += chosen + [o for o in done if o not in chosen][: per_kind - len(chosen)]
    return picked


def planted(request: SoakRequest, chunk_size: int) -> list[int]:
    """``request``'s prompt with its first chunk replaced: what a wrong chunk loaded would amount to."""
    rng = random.Random(f"planted:{request.index}")
    return _random_tokens(rng, chunk_size) + request.tokens[chunk_size:]


def equivalent(reference: dict[str, Any], got: dict[str, Any]) -> tuple[bool, str]:
    """The oracle: same tokens, or tokens that part only at a proven bf16 tie (the concurrent clients' batches are
    not the one-by-one reference's, and a tied pick may go either way), and top-k logits within the drift bound."""
    verdict = compare(reference, got)
    same = verdict.equivalent and verdict.max_logit_steps <= MAX_LOGIT_DRIFT_BF16_STEPS
    return same, f"{verdict.describe()}, max logit drift {verdict.max_logit_steps:.1f} bf16 steps"


def compare_with_reference(base_url: str, sample: list[Outcome], options: SoakOptions) -> dict[str, Any]:
    """Send the sample (and the planted control) one by one to the server without a connector."""
    differences = []
    with openai_client(base_url, options.request_timeout_s) as (client, model):
        for outcome in sample:
            reference = stream_one(client, model, outcome.request.tokens, options.max_tokens)
            assert outcome.result is not None
            same, how = equivalent(reference, outcome.result)
            if not same:
                differences.append({"index": outcome.request.index, "kind": outcome.request.kind, "verdict": how})
        control = next((o for o in sample if o.result and o.result["cached_tokens"]), sample[0])
        assert control.result is not None
        wrong = stream_one(client, model, planted(control.request, options.chunk_size), options.max_tokens)
        caught, how = equivalent(wrong, control.result)
    return {"compared": len(sample), "differences": differences,
            "control": {"index": control.request.index, "caught": not caught, "verdict": how}}


def read_lmcache_metrics(api_port: int) -> dict[str, float]:
    """The worker's LMCache metrics (its internal API server listens on port_start + 1)."""
    return metric_values(http_get(f"http://127.0.0.1:{api_port + 1}/metrics"), LMCACHE_GAUGES)


def summarize(outcomes: list[Outcome], options: SoakOptions, elapsed_s: float) -> dict[str, Any]:
    per_kind: dict[str, dict[str, int]] = {}
    for kind in KINDS:
        done = [o for o in outcomes if o.request.kind == kind and o.result is not None]
        hit_tokens = [o.result["cached_tokens"] or 0 for o in done if o.result is not None]
        per_kind[kind] = {
            "requests": sum(o.request.kind == kind for o in outcomes),
            "answered": len(done),
            "hit_requests": sum(h > 0 for h in hit_tokens),
            "hit_tokens": sum(hit_tokens),
            "all_reusable_hit": sum(o.result["cached_tokens"] == o.request.reusable > 0 for o in done
                                    if o.result is not None),
        }
    latencies = sorted(o.result["latency_s"] for o in outcomes if o.result is not None)
    return {
        "requests": len(outcomes),
        "failed": sum(o.error is not None for o in outcomes),
        "errors": sorted({o.error for o in outcomes if o.error})[:5],
        "elapsed_s": round(elapsed_s, 1),
        "clients": options.clients,
        "by_kind": per_kind,
        "hit_tokens": sum(k["hit_tokens"] for k in per_kind.values()),
        "latency_p50_s": round(latencies[len(latencies) // 2], 3) if latencies else None,
        "latency_max_s": round(latencies[-1], 3) if latencies else None,
    }


def rss_summary(pid: int, rss: RssSampler, elapsed_s: float, end: int) -> dict[str, Any]:
    """RSS figures of one loaded run; growth is from a fifth of the run (eviction running, vLLM's first shapes
    seen) to its end."""
    start = rss.at(elapsed_s / 5)
    return {
        "pid": pid,
        "before_run_mib": round(rss.samples[0][1] / 2**20, 1),
        "start_mib": round(start / 2**20, 1),
        "end_mib": round(end / 2**20, 1),
        "growth_mib": round((end - start) / 2**20, 1),
        "max_mib": round(max(r for _t, r in rss.samples) / 2**20, 1),
        "every_tenth_mib": [round(rss.at(elapsed_s * i / 10) / 2**20, 1) for i in range(11)],
    }


def drive(server: VllmServer, options: SoakOptions, documents: list[list[int]],
          progress: Progress) -> tuple[list[Outcome], float, dict[str, Any]]:
    """The clients against ``server`` while its worker's RSS is sampled: outcomes, seconds, RSS figures."""
    assert server.process is not None
    (worker,) = worker_pids(server.process.pid)
    with RssSampler(worker, options.rss_interval_s) as rss:
        began = time.monotonic()
        outcomes = run_clients(server.base_url, options, documents, progress)
        elapsed = time.monotonic() - began
        end = rss_bytes(worker)
    return outcomes, elapsed, rss_summary(worker, rss, elapsed, end)


def run_soak(options: SoakOptions, progress: Progress) -> dict[str, Any]:
    """One soak run; the report (``problems`` lists what failed its checks).

    The same requests then go to the server without a connector, whose worker's RSS is the baseline: vLLM's
    CPU worker grows by itself under this load (hundreds of MiB over minutes, with glibc's malloc or jemalloc),
    so what the connector must not add is growth beyond that."""
    require_vllm_command()
    model_dir = ensure_model(TINY_MODEL, options.cache_dir, progress)
    options.workdir.mkdir(parents=True, exist_ok=True)
    api_port = free_port_run(2)  # LMCache's internal API servers: the scheduler's, then the worker's
    config = options.workdir / "lmcache.yaml"
    config.write_text(lmcache_yaml(options, api_port))
    kv_config = {"kv_connector": OUR_CONNECTOR, "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    args = soak_serve_args(TINY_MODEL.max_model_len)
    ours = VllmServer.for_model(model_dir, kv_config, args, options.workdir / "ours.log", options.resources,
                                {"LMCACHE_CONFIG_FILE": str(config)})
    reference = VllmServer.for_model(model_dir, None, args, options.workdir / "reference.log", options.resources)
    for server in (ours, reference):
        server.start_timeout_s = options.start_timeout_s
    documents = documents_of(options)
    progress(f"starting vllm serve with {OUR_CONNECTOR} (port {ours.port}) and without a connector "
             f"(port {reference.port})")
    with started([ours, reference]):
        warmup = _random_tokens(random.Random("soak-warmup"), 300)
        for server in (ours, reference):
            with openai_client(server.base_url, options.request_timeout_s) as (client, model):
                stream_one(client, model, warmup, options.max_tokens)
        progress(f"servers ready; {options.clients} clients for {options.duration_s:.0f} s "
                 f"(at most {options.max_requests} requests)")
        outcomes, elapsed, rss = drive(ours, options, documents, progress)
        ended = time.monotonic()
        progress(f"{len(outcomes)} requests in {elapsed:.0f} s; comparing a sample with the reference server")
        sample = pick_sample(outcomes, options.sample)
        oracle = compare_with_reference(reference.base_url, sample, options) if sample else None
        progress("the same requests against the server without a connector (RSS baseline)")
        baseline = replace(options, max_requests=len(outcomes), duration_s=2 * elapsed + 30)
        reference_outcomes, _seconds, reference_rss = drive(reference, baseline, documents, progress)
        reference_rss["failed"] = sum(o.error is not None for o in reference_outcomes)
        time.sleep(max(0.0, ended + STATS_INTERVAL_S + 1.5 - time.monotonic()))
        metrics = read_lmcache_metrics(api_port)
    report = summarize(outcomes, options, elapsed)
    report.update(lmcache=metrics, rss=rss, reference_rss=reference_rss, oracle=oracle,
                  exit_codes=[ours.exit_code, reference.exit_code], cpu_budget_gb=options.cpu_budget_gb)
    report["problems"] = problems(report)
    return report


def problems(report: dict[str, Any], max_rss_growth_mib: float = 64.0) -> list[str]:
    """What a soak run must not show."""
    found = []
    if report["failed"]:
        found.append(f"{report['failed']} of {report['requests']} requests failed: {report['errors']}")
    oracle = report["oracle"]
    if oracle is None:
        found.append("no answered request to compare with the server without a connector")
    else:
        if oracle["differences"]:
            found.append(f"answers differ from the server without a connector: {oracle['differences']}")
        if not oracle["control"]["caught"]:
            found.append(f"the planted difference was not caught ({oracle['control']['verdict']}): the comparison "
                         "proves nothing")
    if report["lmcache"]["pinned"]:
        found.append(f"{report['lmcache']['pinned']:.0f} LMCache memory objects still pinned after the run")
    if report["lmcache"]["forced_unpins"]:
        found.append(f"LMCache force-unpinned {report['lmcache']['forced_unpins']:.0f} objects (a pin leaked)")
    if not report["lmcache"]["evictions"]:
        found.append("LMCache never evicted: the CPU budget did not constrain the run")
    extra = report["rss"]["growth_mib"] - report["reference_rss"]["growth_mib"]
    if extra > max_rss_growth_mib:
        found.append(f"worker RSS grew {report['rss']['growth_mib']} MiB, {extra:.1f} MiB more than without a "
                     f"connector (bound {max_rss_growth_mib} MiB)")
    if report["reference_rss"]["failed"]:
        found.append(f"{report['reference_rss']['failed']} requests to the server without a connector failed")
    if not report["by_kind"]["full"]["hit_requests"] or not report["by_kind"]["partial"]["hit_requests"]:
        found.append("no LMCache hit among full or partial requests")
    return found
