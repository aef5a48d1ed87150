"""The connector names most LMCache users configure, served by ``vllm serve`` with this package installed:
vLLM's ``LMCacheConnectorV1`` (a Gemma-3-like hybrid, which vLLM then serves with one KV-cache group; the dense
model under that name runs in-process in ``tests/integration/test_upstream_names_inprocess.py``, one vLLM server
start pair less) and LMCache's ``LMCacheConnectorV1Dynamic`` through its module path (the dense model). A cold
server answers each prompt twice (the repeat loads from LMCache: vLLM's prefix cache is off), a fresh server loads
every whole chunk from Redis; answers (tokens and top-5 logits) are identical to the cold ones (which computed
everything, as vLLM without a connector does: ``tests/integration/test_upstream_names_inprocess.py`` compares
those with no connector), hit counts exact."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.client import Sampling
from lmcache_platforms.tools.demo.model import TINY_DENSE_MODEL, TINY_MODEL, ModelSpec, ensure_model
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server_pass import ServerPassRunner, serve_args
from lmcache_platforms.tools.demo.workload import FIRST_ORDINARY_TOKEN, Request
from lmcache_platforms.tools.redis_server import RedisServer
from tests.ci import missing
from tests.integration.vllm_env import fp8_cache_refusal

pytestmark = pytest.mark.slow

CHUNK = 64
LENGTHS = (300, 200)  # 4 and 3 whole chunks (vLLM computes the last token itself)


def cpu_tier_env(folder: Path, extra: str = "", cpu_gib: float = 0.5) -> dict[str, str]:
    """The environment of a server whose LMCache keeps ``CHUNK``-token chunks in its local CPU cache of
    ``cpu_gib`` (plus ``extra`` yaml lines)."""
    config = folder / "lmcache.yaml"
    config.write_text(f"chunk_size: {CHUNK}\nlocal_cpu: true\nmax_local_cpu_size: {cpu_gib}\n{extra}")
    return {"LMCACHE_CONFIG_FILE": str(config)}


def _requests(vocab: int) -> list[Request]:
    """Prompts sharing no chunk, so a hit can only be the same prompt's own."""
    span = vocab - FIRST_ORDINARY_TOKEN
    return [Request(f"prompt-{i}", [(t * 37 + i * 101) % span + FIRST_ORDINARY_TOKEN for t in range(n)])
            for i, n in enumerate(LENGTHS)]


@pytest.mark.parametrize(("model", "connector"), [
    (TINY_MODEL, {"kv_connector": "LMCacheConnectorV1"}),
    (TINY_DENSE_MODEL, {"kv_connector": "LMCacheConnectorV1Dynamic",
                        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_connector_v1"}),
], ids=["vllm-LMCacheConnectorV1-gemma3", "lmcache-LMCacheConnectorV1Dynamic-dense"])
def test_upstream_name_serves_identically_with_exact_hits(tmp_path: Path, model: ModelSpec,
                                                          connector: dict[str, str]) -> None:
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server)")
    requests = _requests(model.vocab_size)
    runner = ServerPassRunner(tmp_path, Resources.available(), ensure_model(model),
                              [*serve_args(32, 1024), "--no-enable-prefix-caching"], Sampling(max_tokens=8),
                              progress=lambda _line: None)
    with RedisServer(str(tmp_path)) as redis:
        env = cpu_tier_env(tmp_path, f'remote_url: "{redis.url}"\nremote_serde: naive\n')
        transfer = {**connector, "kv_role": "kv_both"}
        cold = runner.run("cold", transfer, requests + requests, None, env)
        fresh = runner.run("fresh", transfer, requests, None, env)
    for result in (cold, fresh):
        assert result["exit_code"] == 0, Path(result["log"]).read_text()[-3000:]
    log = Path(cold["log"]).read_text()
    assert f"LMCache engine impl wrapped by {connector['kv_connector']}" in log
    assert "TypeError" not in log
    whole = [n // CHUNK * CHUNK for n in LENGTHS]
    assert [r["lmcache_hit_tokens"] for r in cold["requests"]] == [0, 0, *whole]
    assert [r["lmcache_hit_tokens"] for r in fresh["requests"]] == whole
    first = cold["requests"][: len(requests)]
    for repeat in (cold["requests"][len(requests):], fresh["requests"]):
        assert [(r["tokens"], r["top_logits"]) for r in repeat] == [(r["tokens"], r["top_logits"]) for r in first]
    assert all(len(r["tokens"]) == 8 for r in first), json.dumps(first)[:500]


@pytest.mark.parametrize(("extra_args", "extra_env"), [
    (["--kv-cache-dtype", "fp8"], {}),
    (["--tensor-parallel-size", "2"], {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
], ids=["fp8", "tp2"])
def test_what_vllm_serves_without_the_connector_it_serves_with_it(tmp_path: Path, extra_args: list[str],
                                                                    extra_env: dict[str, str]) -> None:
    """The hybrid model under settings vLLM's CPU build serves without a connector: the same answers with
    ``LMCachePlatformsConnector``, and the repeats load every whole chunk."""
    if "--tensor-parallel-size" in extra_args and len(Resources.available().cores) < 2:
        pytest.skip("tensor parallel 2 on CPU needs two cores, one per rank")
    if "fp8" in extra_args and (refusal := fp8_cache_refusal()):
        pytest.skip(f"vLLM's CPU backend keeps no fp8 cache on this CPU (as in-process): {refusal}")
    requests = _requests(TINY_MODEL.vocab_size)
    runner = ServerPassRunner(tmp_path, Resources.available(), ensure_model(TINY_MODEL),
                              [*serve_args(32, 1024), "--no-enable-prefix-caching", *extra_args],
                              Sampling(max_tokens=8), progress=lambda _line: None)
    env = {**cpu_tier_env(tmp_path), **extra_env}
    bare = runner.run("bare", None, requests, None, extra_env)
    served = runner.run("ours", {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
                        requests + requests, None, env)
    for result in (bare, served):
        assert result["exit_code"] == 0, Path(result["log"]).read_text()[-3000:]
    assert [r["lmcache_hit_tokens"] for r in served["requests"]] == [0, 0, *(n // CHUNK * CHUNK for n in LENGTHS)]
    answers = [(r["tokens"], r["top_logits"]) for r in bare["requests"]]
    assert [(r["tokens"], r["top_logits"]) for r in served["requests"]] == answers + answers
