"""An fp8 KV cache (``kv_cache_dtype="fp8"``) on the Gemma-3-like hybrid, in-process through our connector:
every chunk stored and loaded, the repeat answering exactly as the first pass (tokens and top-5 logprobs), and
the cache dtype in the chunk keys (e4m3 and e5m2 caches have the same byte layout)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from tests.fork_server import run_module
from tests.integration.vllm_env import fp8_cache_refusal

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_fp8_cache_round_trips_through_lmcache() -> None:
    if refusal := fp8_cache_refusal():
        pytest.skip(f"vLLM's CPU backend keeps no fp8 cache on this CPU: {refusal}")
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
    proc = run_module("tests.integration.upstream_names_run",
                      [str(ensure_model(TINY_MODEL)), "LMCachePlatformsConnector", "--fp8"], env, REPO, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (result["hma"], result["groups"]) == (True, 4)
    assert (result["chunks_stored"], result["chunks_loaded"]) == (4, 4)
    assert result["key_tags"]["lmcache.tag.lmcp_kv_cache_dtype"] == "fp8"
    cold, warm = result["passes"]
    assert warm == cold
