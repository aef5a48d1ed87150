"""Shared set-up of the connector tests: LMCache without telemetry, quiet logs, a throwaway redis-server
(a missing redis-server skips the Redis tests on a developer's machine and fails them under CI)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_platforms.tools.redis_server import RedisServer
from tests.ci import missing

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


@pytest.fixture(autouse=True)
def quiet_lmcache(monkeypatch: pytest.MonkeyPatch) -> None:
    """LMCache's loggers made during a connector test (and its subprocesses) log warnings and up; set per test, so
    the level does not leak into the other packages' tests, which read LMCache's INFO lines."""
    if "LMCACHE_LOG_LEVEL" not in os.environ:
        monkeypatch.setenv("LMCACHE_LOG_LEVEL", "WARNING")


@pytest.fixture
def patient_remote(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lookup time limits well past what a real store on loopback needs even on a loaded machine, for tests of what
    a remote store holds, not of how long it takes: under CI's load a Redis Cluster client's first lookup (slot
    discovery, connections to every node) once took longer than the 2.5 s connect allowance, and the tier was
    skipped as designed (tests/upstream_fixes/test_remote_lookup.py and tests/reliability/test_stuck_remote.py
    test the limits)."""
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_CONNECT_TIMEOUT_S", "60")
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_LOOKUP_TIMEOUT_S", "30")


@pytest.fixture
def closable_remote_backends() -> None:
    """LMCache 0.5.6's remote backends deadlock on close; the patch catalog fixes it (upstream_fixes.remote_close)
    once activation has run and LMCache's executor module is imported."""
    import lmcache.v1.storage_backend.job_executor.pq_executor as pq_executor

    from lmcache_platforms import ensure_patched
    from lmcache_platforms.upstream_fixes.remote_close import pq_executor_shutdown

    ensure_patched()
    assert pq_executor.AsyncPQExecutor.shutdown is pq_executor_shutdown


@pytest.fixture
def redis_url(tmp_path: Path, closable_remote_backends: None) -> Iterator[str]:
    """``redis://127.0.0.1:PORT`` of a private redis-server (no persistence), stopped after the test."""
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it "
                "when run as root, as `make test` does)")
    with RedisServer(str(tmp_path)) as server:
        yield server.url
