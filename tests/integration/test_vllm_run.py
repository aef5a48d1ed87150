"""Real vLLM (CPU, one process) with the hybrid KV-cache manager on: the second run of a prompt loads its
prefix from LMCache through our connector and produces the same tokens; the process exits cleanly. Both load
modes, each through vLLM's wait state (the model has several KV-cache groups): ``sync`` (the default: the step
waits for the load) and ``async`` (the step goes on while the loader thread works)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fork_server import run_module

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("extra", [{}, {"platforms.load_mode": "async"}], ids=["default", "async"])
def test_second_run_hits_lmcache_and_matches(extra):
    from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model

    model = ensure_model(TINY_MODEL)
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
    proc = run_module("tests.integration.vllm_run", [str(model), json.dumps(extra)], env, REPO, timeout=400,
                      engine=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["hma"] is True
    assert result["groups"].count("SlidingWindowSpec") == 3 and "FullAttentionSpec" in result["groups"]
    assert (result["chunks_stored"], result["chunks_loaded"]) == (4, 4)  # 300 tokens: 4 whole chunks of 64
    assert result["outputs"][0] == result["outputs"][1]
    assert not any(e["degraded"] for e in result["health"])
