"""Shared set-up of the connector tests: LMCache without telemetry, quiet logs, a throwaway redis-server
(a missing redis-server skips the Redis tests on a developer's machine and fails them under CI)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ci import missing

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


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
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it "
                "when run as root, as `make test` does)")
    port = _free_port()
    server = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 10
        while not _answers_ping(port):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"redis-server on port {port} did not start (exit code {server.poll()})")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
