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


# What the captured server did (tests/serving/test_readme_serving.py): 3 prompts of 264, 269 and 273 tokens, each
# asked cold (stored: one 256-token chunk each), then warm after vLLM's prefix cache was reset (loaded from
# LMCache's CPU tier: 256 hit tokens each); a chunk object is 328,192 bytes.
PROMPT_TOKENS = 264 + 269 + 273
HITS = 3 * 256
OBJECT_BYTES = 328_192
CAUSES = ["corrupt", "error", "missing", "timeout", "unregistered"]


def page(when: str) -> bytes:
    return (DATA / f"metrics_after_{when}.txt").read_bytes()


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def counts_of(when: str) -> dict[str, float]:
    return stats.totals(page(when).decode(), "captured")


def test_since_start_after_the_cold_pass() -> None:
    figures = stats.figures(counts_of("cold"))
    assert figures["prompt_tokens"] == PROMPT_TOKENS  # vllm:prompt_tokens only, not ..._by_source
    assert (figures["hit_tokens"], figures["hit_rate"]) == (0, 0.0)
    assert (figures["stores"], figures["chunks_stored"], figures["bytes_stored"]) == (3, 3, 3 * OBJECT_BYTES)
    assert (figures["loads"], figures["bytes_loaded"], figures["load_seconds"]) == (0, 0, 0.0)
    assert (figures["load_ms_mean"], figures["load_bytes_per_s"]) == (None, None)  # no load: no time to divide
    assert figures["loads_failed_by_cause"] == dict.fromkeys(CAUSES, 0) and figures["loads_failed"] == 0
    assert figures["tier_bytes_read"] == {}  # the family appears with its first load


def test_since_start_after_the_warm_pass() -> None:
    counts = counts_of("warm")
    figures = stats.figures(counts)
    assert (figures["prompt_tokens"], figures["hit_tokens"]) == (2 * PROMPT_TOKENS, HITS)
    assert figures["hit_rate"] == HITS / (2 * PROMPT_TOKENS)
    assert (figures["loads"], figures["chunks_loaded"], figures["bytes_loaded"]) == (3, 3, 3 * OBJECT_BYTES)
    assert figures["tier_bytes_read"] == {"LocalCPUBackend": 3 * OBJECT_BYTES}
    assert figures["load_seconds"] == counts["load_seconds_sum"] > 0
    assert figures["load_ms_mean"] == 1000 * counts["load_seconds_sum"] / 3
    assert figures["load_bytes_per_s"] == 3 * OBJECT_BYTES / counts["load_seconds_sum"]
    assert figures["loads_failed_by_cause"] == dict.fromkeys(CAUSES, 0)


def test_the_interval_between_the_passes_is_the_warm_pass() -> None:
    figures = stats.figures(stats.difference(counts_of("warm"), counts_of("cold")))
    assert (figures["prompt_tokens"], figures["hit_tokens"]) == (PROMPT_TOKENS, HITS)
    assert figures["hit_rate"] == HITS / PROMPT_TOKENS
    assert (figures["stores"], figures["bytes_stored"], figures["store_seconds"]) == (0, 0, 0.0)
    assert (figures["loads"], figures["bytes_loaded"]) == (3, 3 * OBJECT_BYTES)
    assert figures["tier_bytes_read"] == {"LocalCPUBackend": 3 * OBJECT_BYTES}  # first seen in the later sample
    assert figures["loads_failed_by_cause"] == dict.fromkeys(CAUSES, 0)


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


def test_the_command_over_an_interval(capsys: pytest.CaptureFixture[str], serve_pages) -> None:
    """Two samples of a server, a short interval apart: the cold pass's page, then the warm pass's."""
    url = serve_pages(page("cold"), page("warm"))
    assert main(["stats", url, "--interval", "0.2", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["url"] == f"{url}/metrics" and result["interval_seconds"] >= 0.2
    assert result["since_start"] == stats.figures(counts_of("warm"))
    assert result["interval"] == stats.figures(stats.difference(counts_of("warm"), counts_of("cold")))


def test_the_table(capsys: pytest.CaptureFixture[str], serve_pages) -> None:
    url = serve_pages(page("cold"), page("warm"))
    assert main(["stats", f"{url}/metrics", "--interval", "0.2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{url}/metrics: LMCache connector, summed over engines and models"
    assert lines[1].split()[:3] == ["since", "start", "last"]  # "last 0.2 s", or more on a busy machine
    rows = {}
    for line in lines[2:]:
        label, since_start, interval = line.rsplit(maxsplit=2)
        rows[label.strip()] = [since_start, interval]
    assert rows["prompt_tokens"] == [str(2 * PROMPT_TOKENS), str(PROMPT_TOKENS)]
    assert rows["hit_rate"] == ["0.476", "0.953"]  # 768 / 1612, 768 / 806
    assert rows["store_ms_mean"][1] == "-"  # no store in the interval: no mean
    assert rows["loads_failed_by_cause: missing"] == ["0", "0"]
    assert rows["tier_bytes_read: LocalCPUBackend"] == [str(3 * OBJECT_BYTES)] * 2


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
