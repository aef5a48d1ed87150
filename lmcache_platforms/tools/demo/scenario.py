"""The demo's sequence: model, workload, then cold and warm passes per configuration, each pass a fresh
``vllm serve`` driven by a streaming client.

Where LMCache keeps the KV cache between passes: LMCache's ``fs://`` remote backend (one file per chunk under
the run's folder, behind the usual local CPU cache). A pass is a whole process that exits, so the data must
outlive it; files need no server (Redis would), keep every KV-cache group of a chunk in one object (the
connector's MemoryObj holds one tensor per group and the fs backend stores their shapes and dtypes with it),
and reading them back comes from the page cache. Each pass waits for its writes before it exits.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_platforms.tools.demo.client import Sampling
from lmcache_platforms.tools.demo.model import MODELS, ModelSpec, ensure_model
from lmcache_platforms.tools.demo.runners import LMCacheServer, PassFailed, Resources
from lmcache_platforms.tools.demo.server import require_vllm_command
from lmcache_platforms.tools.demo.server_pass import ServerPassRunner, serve_args
from lmcache_platforms.tools.demo.workload import WORKLOADS, Request, WorkloadSpec, build_workload, warmup_request

OUR_CONNECTOR = "LMCachePlatformsConnector"
UPSTREAM_CONNECTOR = "LMCacheConnectorV1"
# vLLM's CPU backend wants block sizes that are multiples of 32; LMCache's server wants block = chunk size.
BLOCK_SIZE = 32
SERVER_CHUNK_SIZE = 32
TOP_LOGITS = 5
STORE_DIR = "lmcache_store"
CONFIG_FILE = "lmcache.yaml"


@dataclass(frozen=True)
class DemoOptions:
    size: str = "demo"
    compare: bool = False
    chunk_size: int = 256
    workdir: Path = Path(".")
    cache_dir: Path | None = None
    resources: Resources = field(default_factory=Resources.available)
    pass_timeout_s: float = 600.0
    # Added to our connector's passes only (e.g. a kernel backend chosen by a test).
    extra_env: dict[str, str] = field(default_factory=dict)
    # Keep the store (``STORE_DIR`` under the workdir) after the run, for another pass configured with the
    # workdir's ``lmcache.yaml`` (``CONFIG_FILE``); by default it is removed.
    keep_store: bool = False


@dataclass
class Outcome:
    """What one configuration gave: its passes' results, or why it could not run."""

    label: str
    passes: dict[str, dict[str, Any]] = field(default_factory=dict)
    error: str | None = None


@dataclass
class DemoRun:
    model: ModelSpec
    workload: WorkloadSpec
    requests: list[Request]
    options: DemoOptions
    outcomes: dict[str, Outcome] = field(default_factory=dict)


def lmcache_yaml(chunk_size: int, store: Path, cpu_gib: float = 1.0) -> str:
    """LMCache's config for our passes: local CPU cache in front of a persistent ``fs://`` store.

    LMCache's URL parser insists on a host and a port even for files; the fs backend uses only the path.
    """
    return (
        f"chunk_size: {chunk_size}\n"
        "local_cpu: true\n"
        f"max_local_cpu_size: {cpu_gib}\n"
        f'remote_url: "fs://localhost:0{store.resolve()}"\n'
        "remote_serde: naive\n"
    )


def connector_config(name: str) -> dict[str, Any]:
    return {"kv_connector": name, "kv_role": "kv_both"}


def run_demo(options: DemoOptions, progress: Callable[[str], None]) -> DemoRun:
    """Run every configuration the options ask for; failures of compared configurations are recorded."""
    model, workload = MODELS[options.size], WORKLOADS[options.size]
    model_dir = ensure_model(model, options.cache_dir, progress)
    requests = build_workload(workload, model.vocab_size)
    run = DemoRun(model, workload, requests, options)
    options.workdir.mkdir(parents=True, exist_ok=True)
    require_vllm_command()
    runner = ServerPassRunner(options.workdir, options.resources, model_dir,
                              serve_args(BLOCK_SIZE, model.max_model_len),
                              Sampling(workload.max_tokens, TOP_LOGITS), progress, options.pass_timeout_s)
    longest = max(len(r.tokens) for r in requests)

    def warmup(label: str) -> Request:
        return warmup_request(longest, model.vocab_size, label)

    store = options.workdir / STORE_DIR
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    config_file = options.workdir / CONFIG_FILE
    config_file.write_text(lmcache_yaml(options.chunk_size, store))
    ours = run.outcomes.setdefault("ours", Outcome("LMCache in-process + lmcache_platforms"))
    env = {"LMCACHE_CONFIG_FILE": str(config_file), **options.extra_env}
    try:
        for phase in ("cold", "warm"):
            progress(f"pass {phase} with {OUR_CONNECTOR} (fresh server)")
            ours.passes[phase] = runner.run(f"ours-{phase}", connector_config(OUR_CONNECTOR), requests,
                                            warmup(f"ours-{phase}"), env)
    finally:
        if not options.keep_store:
            shutil.rmtree(store, ignore_errors=True)
    if options.compare:
        _run_comparisons(run, runner, warmup, progress)
    return run


def _run_comparisons(run: DemoRun, runner: ServerPassRunner, warmup: Callable[[str], Request],
                     progress: Callable[[str], None]) -> None:
    none = run.outcomes.setdefault("none", Outcome("vLLM, no connector"))
    progress("pass with no connector (fresh server)")
    try:
        none.passes["cold"] = runner.run("none", None, run.requests, warmup("none"))
    except PassFailed as exc:
        none.error = str(exc)
    server = run.outcomes.setdefault("server", Outcome("LMCache server mode (LMCacheMPConnector)"))
    chunk = SERVER_CHUNK_SIZE
    if chunk != BLOCK_SIZE or run.model.sliding_window % BLOCK_SIZE:
        server.error = (f"needs block size = chunk size = {chunk} and a sliding window that is a multiple of the "
                        f"block size (have {BLOCK_SIZE}, window {run.model.sliding_window})")
        return
    progress(f"starting LMCache server (chunk size {chunk})")
    try:
        with LMCacheServer(run.options.workdir, run.options.resources, chunk) as lmcache_server:
            mp_env = {"LMCACHE_MP_TRANSFER_MODE": "lmcache_driven"}
            for phase in ("cold", "warm"):
                progress(f"pass {phase} with LMCacheMPConnector (fresh server)")
                server.passes[phase] = runner.run(f"server-{phase}", lmcache_server.kv_transfer_config(),
                                                  run.requests, warmup(f"server-{phase}"), mp_env)
    except PassFailed as exc:
        server.error = str(exc)
