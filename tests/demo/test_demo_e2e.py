"""The reduced demo end to end: real vLLM CPU engines in subprocesses, real LMCache, the tiny model.

One cold and one warm pass (fresh engine) with our connector must give LMCache hits, identical tokens and at
least two KV-cache groups; upstream's in-process connector must be refused by vLLM with the hybrid manager on.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from lmcache_platforms.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.demo.report import problems, render, summary
from lmcache_platforms.demo.runners import PassFailed, PassRunner, Resources
from lmcache_platforms.demo.scenario import (
    UPSTREAM_CONNECTOR,
    DemoOptions,
    DemoRun,
    connector_config,
    pass_spec,
    run_demo,
)
from lmcache_platforms.demo.workload import TINY_WORKLOAD, build_workload

pytestmark = pytest.mark.slow


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    ensure_model(TINY_MODEL, folder)
    return folder


@pytest.fixture(scope="module")
def tiny_run(models: Path, tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    workdir = tmp_path_factory.mktemp("demo")
    run = run_demo(DemoOptions(size="tiny", workdir=workdir, cache_dir=models, chunk_size=64), lambda _m: None)
    assert _processes_mentioning(str(workdir)) == [], "an engine pass left a process behind"
    return run


def test_warm_pass_hits_lmcache_with_identical_tokens_on_a_hybrid_model(tiny_run: DemoRun) -> None:
    result = summary(tiny_run)
    cold, warm = tiny_run.outcomes["ours"].passes["cold"], tiny_run.outcomes["ours"].passes["warm"]
    specs = {g["spec"] for g in cold["kv_groups"]}
    assert result["kv_groups"] >= 2 and {"SlidingWindowSpec", "FullAttentionSpec"} <= specs
    assert result["hit_tokens"] > 0
    assert all(r["lmcache_hit_tokens"] > 0 for r in warm["requests"])
    assert result["identical"], render(tiny_run)
    assert problems(result) == []
    assert [len(r["tokens"]) for r in warm["requests"]] == [TINY_WORKLOAD.max_tokens] * TINY_WORKLOAD.requests


def test_vllm_refuses_upstream_in_process_connector_with_the_hybrid_manager(models: Path, tmp_path: Path) -> None:
    requests = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)[:1]
    spec = pass_spec(models / TINY_MODEL.name, TINY_MODEL, TINY_WORKLOAD, requests, "upstream",
                     connector_config(UPSTREAM_CONNECTOR))
    runner = PassRunner(tmp_path, Resources.available(), lambda _m: None, timeout_s=300)
    with pytest.raises(PassFailed, match="does not support HMA but HMA is enabled"):
        runner.run("upstream", spec)
    assert _processes_mentioning(str(tmp_path)) == []
