"""Shared set-up of the fault tests: the tiny hybrid model, engine runs in subprocesses, and the reference answers
of vLLM without a connector (computed once per session, for every prompt a scenario uses)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.ci import missing
from tests.fork_server import run_module
from tests.session_cache import cached, folder_digest, session_folder

REPO = Path(__file__).resolve().parents[2]
# Every prompt a scenario of tests/reliability uses (fault_run.prompt builds it from its name).
PROMPTS = ("full", "ok/140", "kernel/140", "pinned/140", "rival", "zero/140", "shape", "trunc", "meta", "stop",
           "garbage", "deleted", "cut", "one/100", "victim", "bystander")
# Our connector's line for a load that came back short, and for one whose KV write failed.
SHORT_LOAD = re.compile(r"LMCache returned (\d+) of (\d+) expected tokens; failed from token (\d+)")
WRITE_FAILED = re.compile(r"LMCache load of (\d+) tokens failed: (.*)")


def failed_loads(log: list[str]) -> list[str]:
    """Our connector's ERROR lines that report one request's load failed (one line per failed load)."""
    return [line for line in log if line.startswith("ERROR lmcache_platforms.integration.vllm.worker_loads")
            and (SHORT_LOAD.search(line) or WRITE_FAILED.search(line))]


@pytest.fixture(scope="session")
def model() -> Path:
    from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model

    return ensure_model(TINY_MODEL)


def run_engine(spec: dict[str, Any], workdir: Path, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One ``tests.reliability.fault_run`` process; its JSON result (the process's log is kept in workdir)."""
    spec_path = workdir / "spec.json"
    spec_path.write_text(json.dumps(spec))
    environ = {**(env or os.environ), "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false",
               "LMCACHE_LOG_LEVEL": "INFO"}
    environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), environ.get("PYTHONPATH", "")) if p)
    log = workdir / "engine.log"
    with log.open("w") as out:
        proc = run_module("tests.reliability.fault_run", [str(spec_path)], environ, REPO, timeout=500, engine=True)
        out.write(proc.stderr)
    assert proc.returncode == 0, log.read_text()[-6000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def reference(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Every prompt's greedy answer from vLLM without a connector, once per session (the modules using it may run
    on either worker)."""
    spec = {"connector": None, "policy": "recompute", "prompts": list(PROMPTS)}
    key = {"run": "tests.reliability.fault_run", "model": folder_digest(model), **spec}
    return cached(session_folder(tmp_path_factory), key,
                  lambda: run_engine({"model": str(model), **spec}, tmp_path_factory.mktemp("reference"))["reference"])


@pytest.fixture(scope="session")
def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it)")
    return binary
