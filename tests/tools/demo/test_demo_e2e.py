"""The reduced demo end to end, through the paths users run: ``vllm serve`` (multiprocess engine) driven by a
streaming client, and an in-process ``LLM`` engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), both with real LMCache
and the tiny hybrid model. Each configuration must give exactly the expected LMCache hits and the tokens of a
server without a connector; upstream's in-process connector must be refused by vLLM with the hybrid manager on.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from lmcache_platforms.tools.demo.client import Sampling
from lmcache_platforms.tools.demo.engine_pass import pass_spec
from lmcache_platforms.tools.demo.identity import compare
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.report import (
    MAX_LOGIT_DRIFT_BF16_STEPS,
    expected_hit_tokens,
    problems,
    render,
    summary,
)
from lmcache_platforms.tools.demo.runners import PassFailed, PassRunner, Resources
from lmcache_platforms.tools.demo.scenario import (
    BLOCK_SIZE,
    CONFIG_FILE,
    OUR_CONNECTOR,
    STORE_DIR,
    TOP_LOGITS,
    UPSTREAM_CONNECTOR,
    DemoOptions,
    DemoRun,
    Outcome,
    connector_config,
    lmcache_yaml,
    run_demo,
)
from lmcache_platforms.tools.demo.server_pass import ServerPassRunner, serve_args
from lmcache_platforms.tools.demo.workload import TINY_WORKLOAD, build_workload, warmup_request
from tests.faults.install import faulty_env, install_faulty_backend
from tests.serving.processes import processes_mentioning
from tests.session_cache import cached, folder_digest, session_folder

pytestmark = pytest.mark.slow

CHUNK = 64
REQUESTS = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)
EXPECTED_HITS = [expected_hit_tokens(len(r.tokens), CHUNK) for r in REQUESTS]
SERVE_ARGS = serve_args(BLOCK_SIZE, TINY_MODEL.max_model_len)


def serve_pass(models: Path, workdir: Path, label: str, kv_transfer_config: dict[str, Any] | None,
               env: dict[str, str] | None = None) -> dict[str, Any]:
    """One fresh ``vllm serve`` of the tiny model answering ``REQUESTS`` after a warm-up, as the demo's passes."""
    runner = ServerPassRunner(workdir, Resources.available(), models / TINY_MODEL.name, SERVE_ARGS,
                              Sampling(TINY_WORKLOAD.max_tokens, TOP_LOGITS), lambda _m: None)
    longest = max(len(r.tokens) for r in REQUESTS)
    return runner.run(label, kv_transfer_config, REQUESTS, warmup_request(longest, TINY_MODEL.vocab_size, label), env)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("models")
    ensure_model(TINY_MODEL, folder)
    return folder


@pytest.fixture(scope="module")
def tiny_run(models: Path, tmp_path_factory: pytest.TempPathFactory) -> DemoRun:
    """The tiny demo, its store kept: the zeroed-block control's warm pass reads what its cold pass stored."""
    workdir = tmp_path_factory.mktemp("demo")
    run = run_demo(DemoOptions(size="tiny", workdir=workdir, cache_dir=models, chunk_size=CHUNK, keep_store=True),
                   lambda _m: None)
    assert processes_mentioning(str(workdir)) == [], "a server left a process behind"
    assert any((workdir / STORE_DIR).iterdir()), "the kept store is empty"
    return run


@pytest.fixture(scope="module")
def no_connector(models: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The answers of a server without a connector: what users would get anyway. Computed once per session
    (``tests/session_cache.py``): the module's tests are split over the workers (``tests/conftest.py``)."""
    def serve() -> dict[str, Any]:
        return serve_pass(models, tmp_path_factory.mktemp("none"), "none", None)

    key = {"baseline": "vllm serve, no connector", "model": folder_digest(models / TINY_MODEL.name),
           "args": SERVE_ARGS, "prompts": [r.tokens for r in REQUESTS], "max_tokens": TINY_WORKLOAD.max_tokens,
           "top_logits": TOP_LOGITS}
    return cached(session_folder(tmp_path_factory), key, serve)


def _assert_same_answers(reference: dict[str, Any], result: dict[str, Any]) -> None:
    for expected, got in zip(reference["requests"], result["requests"], strict=True):
        verdict = compare(expected, got)
        assert verdict.identical, (got["name"], verdict.describe())
        assert verdict.max_logit_steps <= MAX_LOGIT_DRIFT_BF16_STEPS, (got["name"], verdict.max_logit_steps)


def test_served_warm_pass_loads_every_whole_chunk_and_answers_as_without_a_connector(
        tiny_run: DemoRun, no_connector: dict[str, Any]) -> None:
    result = summary(tiny_run)
    cold, warm = tiny_run.outcomes["ours"].passes["cold"], tiny_run.outcomes["ours"].passes["warm"]
    specs = [g["spec"] for g in cold["kv_groups"]]
    assert specs == ["SlidingWindowSpec"] * 3 + ["FullAttentionSpec"], specs
    assert result["kv_groups"] == 4
    assert result["hit_tokens_per_request"] == EXPECTED_HITS
    assert [r["vllm_hit_tokens"] for r in warm["requests"]] == [0] * len(REQUESTS)
    assert result["identical"] and result["max_logit_drift_bf16_steps"] <= MAX_LOGIT_DRIFT_BF16_STEPS, render(tiny_run)
    assert problems(result) == []
    assert [p["exit_code"] for p in (cold, warm)] == [0, 0]
    assert [len(r["tokens"]) for r in warm["requests"]] == [TINY_WORKLOAD.max_tokens] * TINY_WORKLOAD.requests
    _assert_same_answers(no_connector, cold)
    _assert_same_answers(no_connector, warm)


def test_the_served_verdict_catches_a_zeroed_block_on_load(models: Path, tiny_run: DemoRun,
                                                           no_connector: dict[str, Any],
                                                           tmp_path_factory: pytest.TempPathFactory) -> None:
    """Negative control: a warm pass over the tiny demo's store (a fresh server, as the demo's own warm pass)
    with a kernel backend (a plugin, found through its entry point by the server's worker) that zeroes the first
    block of every load. Hits are still exact, so only the answer checks can catch it: they must."""
    plugin = install_faulty_backend(tmp_path_factory.mktemp("plugin"))
    workdir = tiny_run.options.workdir
    env = {"LMCACHE_CONFIG_FILE": str(workdir / CONFIG_FILE), **faulty_env(plugin, "zero", base={})}
    warm = serve_pass(models, workdir, "zeroed-warm", connector_config(OUR_CONNECTOR), env)
    cold = tiny_run.outcomes["ours"].passes["cold"]
    run = DemoRun(tiny_run.model, tiny_run.workload, REQUESTS, tiny_run.options,
                  {"ours": Outcome("zeroed on load", {"cold": cold, "warm": warm})})
    result = summary(run)
    assert result["hit_tokens_per_request"] == EXPECTED_HITS
    found = problems(result)
    assert any("drifted" in p or "different tokens" in p for p in found), (found, render(run))
    assert any(not compare(r, w).identical or compare(r, w).max_logit_steps > MAX_LOGIT_DRIFT_BF16_STEPS
               for r, w in zip(no_connector["requests"], warm["requests"], strict=True))
    assert "kernels faulty, " in Path(warm["log"]).read_text()  # the server's worker really ran the plugin
    assert processes_mentioning(str(workdir)) == []


def test_served_layerwise_mode_hits_and_answers_as_without_a_connector(
        models: Path, no_connector: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> None:
    """LMCache's ``use_layerwise`` through ``vllm serve`` (``LMCACHE_USE_LAYERWISE=True``, as users set LMCache's
    keys): the cold server stores every chunk layer by layer as the forward writes it, a fresh server loads every
    whole chunk (while each request waits: several groups) and answers as vLLM without a connector. The zeroed
    block above is this oracle's negative control."""
    workdir = tmp_path_factory.mktemp("layerwise")
    run = run_demo(DemoOptions(size="tiny", workdir=workdir, cache_dir=models, chunk_size=CHUNK,
                               extra_env={"LMCACHE_USE_LAYERWISE": "True"}), lambda _m: None)
    result = summary(run)
    assert result["hit_tokens_per_request"] == EXPECTED_HITS
    assert problems(result) == []
    assert not (workdir / STORE_DIR).exists(), "the store outlived the run (keep_store is off)"
    cold, warm = run.outcomes["ours"].passes["cold"], run.outcomes["ours"].passes["warm"]
    # One store per request and one for the warm-up, each layer by layer (no line without the words).
    stored = re.findall(r"stored tokens \[\d+, \d+\) in LMCache, \d+ bytes written(, layer by layer)?",
                        Path(cold["log"]).read_text())
    assert stored == [", layer by layer"] * (len(REQUESTS) + 1)
    _assert_same_answers(no_connector, cold)
    _assert_same_answers(no_connector, warm)


def test_in_process_engine_with_our_connector_hits_and_answers_as_without_a_connector(
        models: Path, no_connector: dict[str, Any], tmp_path: Path) -> None:
    """``LLM(...)`` in one process, our package never imported by the script: vLLM's plugin loader activates
    it after vLLM's connector factory is already imported (the order that once lost our connector's name)."""
    config = tmp_path / "lmcache.yaml"
    config.write_text(lmcache_yaml(CHUNK, tmp_path / "store", cpu_gib=0.5))
    runner = PassRunner(tmp_path, Resources.available(), lambda _m: None, timeout_s=400)
    passes = {}
    for phase in ("cold", "warm"):
        spec = pass_spec(models / TINY_MODEL.name, TINY_MODEL, TINY_WORKLOAD, REQUESTS, f"in-process-{phase}",
                         connector_config(OUR_CONNECTOR))
        passes[phase] = runner.run(f"in-process-{phase}", spec, {"LMCACHE_CONFIG_FILE": str(config)})
    assert len(passes["warm"]["kv_groups"]) == 4
    assert [r["lmcache_hit_tokens"] for r in passes["warm"]["requests"]] == EXPECTED_HITS
    _assert_same_answers(no_connector, passes["cold"])
    _assert_same_answers(no_connector, passes["warm"])
    assert processes_mentioning(str(tmp_path)) == []


def test_vllm_refuses_upstream_in_process_connector_with_the_hybrid_manager(models: Path, tmp_path: Path) -> None:
    spec = pass_spec(models / TINY_MODEL.name, TINY_MODEL, TINY_WORKLOAD, REQUESTS[:1], "upstream",
                     connector_config(UPSTREAM_CONNECTOR))
    runner = PassRunner(tmp_path, Resources.available(), lambda _m: None, timeout_s=300)
    with pytest.raises(PassFailed, match="does not support HMA but HMA is enabled"):
        runner.run("upstream", spec)
    assert processes_mentioning(str(tmp_path)) == []
