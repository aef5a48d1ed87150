"""`lmcache-platforms stats`: the figures of /metrics pages a real `vllm serve` with our connector exported (captured
in tests/cli/data/, see their headers), read since start and over an interval, served by a real HTTP server; every
user mistake exits 2 with one stderr line. The same command against a live server, with the hits that server's
test knows: tests/serving/test_readme_serving.py."""

from __future__ import annotations

import http.server
import json
import socket
import threading
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from lmcache_platforms.cli import stats
from lmcache_platforms.cli.main import main
from lmcache_platforms.integration.vllm import stats as connector_stats

DATA = Path(__file__).parent / "data"


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def test_the_families_read_are_the_connectors() -> None:
    """The command reads the connector's names without importing vLLM: the same names."""
    assert stats.PREFIX == connector_stats.PREFIX
    assert set(stats.COUNTERS) <= set(connector_stats.COUNTERS)
    assert set(stats.TIMINGS) == set(connector_stats.TIMINGS)
    tier_label = connector_stats.LABELLED["tier_bytes_read"][0]
    assert {"loads_failed": "cause", "tier_bytes_read": tier_label} == stats.BY_LABEL
    assert "loads_failed" in connector_stats.COUNTERS


@pytest.mark.parametrize(("given", "read"), [
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000/metrics"),
    ("http://127.0.0.1:8000/metrics", "http://127.0.0.1:8000/metrics"),
    ("localhost:8000", "http://localhost:8000/metrics"),
])
def test_a_base_url_reads_its_metrics_page(given: str, read: str) -> None:
    assert stats.metrics_url(given) == read


class _Pages(http.server.BaseHTTPRequestHandler):
    """Answers GET with the server's next page (the last one again once all were sent): a server's /metrics
    between two samples, replayed."""

    def do_GET(self) -> None:
        pages: list[bytes] = self.server.pages  # type: ignore[attr-defined]
        body = pages.pop(0) if len(pages) > 1 else pages[0]
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        """Quiet: the test's output is the command's."""


@pytest.fixture
def serve_pages() -> Iterator:
    """``serve(*pages)``: a local HTTP server answering those pages in turn; its base URL."""
    servers = []

    def serve(*pages: bytes) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
        server.pages = list(pages)  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _mistake(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The command's one stderr line, having checked it exits 2 and prints nothing else."""
    assert main(["stats", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    return line


def test_an_unreachable_server_is_named_with_the_error(capsys: pytest.CaptureFixture[str]) -> None:
    port = _free_port()
    assert _mistake([f"http://127.0.0.1:{port}"], capsys) == (
        f"lmcache-platforms stats: cannot read http://127.0.0.1:{port}/metrics: [Errno 111] Connection refused")


class _QuietFiles(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        """Quiet: the test's output is the command's."""


def test_a_missing_page_is_named_with_the_http_error(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(_QuietFiles, directory=str(tmp_path)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/nothing/metrics"
        assert _mistake([url], capsys) == f"lmcache-platforms stats: cannot read {url}: HTTP Error 404: File not found"
    finally:
        server.shutdown()
        server.server_close()


def test_a_page_that_is_not_prometheus_text(capsys: pytest.CaptureFixture[str], serve_pages) -> None:
    url = serve_pages(b"<html><body>vLLM</body></html>\n")
    assert _mistake([url], capsys) == (f"lmcache-platforms stats: {url}/metrics did not answer Prometheus text "
                                       "(invalid metric name:<html><body>vLLM</body></html>)")


def test_a_server_without_our_families(capsys: pytest.CaptureFixture[str]) -> None:
    registry = CollectorRegistry()
    Counter("vllm:prompt_tokens", "vLLM's own counter, without our connector", registry=registry).inc(5)
    server, _thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        url = f"http://127.0.0.1:{server.server_port}/metrics"
        assert _mistake([url], capsys) == (
            f"lmcache-platforms stats: {url} exports none of the connector's families (vllm:lmcache_platforms_*): "
            "LMCachePlatformsConnector is probably not configured (--kv-transfer-config)")
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(("option", "value"), [
    ("--interval", "0"), ("--interval", "-1"), ("--interval", "nan"), ("--interval", "inf"), ("--timeout", "0"),
])
def test_a_bad_number_of_seconds(capsys: pytest.CaptureFixture[str], option: str, value: str) -> None:
    """Refused before anything is read: the URL leads nowhere."""
    assert _mistake(["http://127.0.0.1:1", option, value], capsys) == (
        f"lmcache-platforms stats: {option} must be a number of seconds above 0, got {float(value):g}")
