"""A remote store that accepts connections and never answers (a stuck Redis) must not hang anything.

The stuck store is the one thing here that is not real: a loopback TCP server, written below, that accepts
and then reads nothing and answers nothing. Everything else is LMCache's Redis remote backend as configured by
users (``remote_url: redis://...``), behind a real engine or a real ``vllm serve``.

Where a stuck store blocks, and what bounds it (see docs/reliability.md, Stuck remote store):
  - lookup (does the store hold this chunk?): upstream waits without a limit; ours at most
    ``platforms.remote_connect_timeout_s`` for the first one on a connection and
    ``platforms.remote_lookup_timeout_s`` after it, then skips the store until the late answer and for a time in
    proportion to it, at most ``platforms.remote_retry_s``;
  - load (read a chunk the lookup found): LMCache's ``blocking_timeout_secs``, and our ``platforms.load_timeout_s``
    around the whole load on the loader thread;
  - store: LMCache writes to the remote store asynchronously; the engine only copies into its CPU cache;
  - shutdown: writes in flight are waited for at most ``platforms.drain_timeout_s``, and closing the remote
    connection (upstream's waits for ever once a job waits on the store) at most
    ``platforms.remote_close_timeout_s``.
"""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lmcache_platforms.connector.remote_lookups import remote_lookup_counts
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from tests.serving.observe import PREFIX, scrape

pytestmark = [pytest.mark.slow]

LOOKUP_TIMEOUT_S = 0.5
CONNECT_TIMEOUT_S = 1.0


class StuckServer:
    """Accepts every connection on a loopback port and never reads or writes a byte."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True, name="stuck-redis")
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                self.connections.append(self.listener.accept()[0])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for connection in [*self.connections, self.listener]:
            connection.close()


@pytest.fixture
def stuck_redis() -> Iterator[StuckServer]:
    server = StuckServer()
    yield server
    server.close()


def _timed(call):
    started = time.monotonic()
    result = call()
    return result, time.monotonic() - started


def _a_load_from_the_stuck_store_is_reported_failed_at_the_load_timeout(engine: LayoutEngine) -> None:
    """A load on our loader thread whose remote read hangs: reported failed at ``load_timeout_s`` while the read
    still waits, the read itself ends at LMCache's ``blocking_timeout_secs``, and its late write is refused."""
    from lmcache_platforms.integration.vllm.async_loads import AsyncLoads, LoadGuard

    (remote,) = [b for name, b in engine.engine.storage_manager.storage_backends.items() if "Remote" in name]
    key = next(iter(engine.engine.storage_manager.storage_backends["LocalCPUBackend"].hot_cache))
    writes: list[str] = []
    read_done, write_tried = threading.Event(), threading.Event()

    def load(req_id: str, guard: LoadGuard) -> bool:
        got = remote.get_blocking(key)
        read_done.set()
        guard.run(lambda: writes.append(req_id))
        write_tried.set()
        return got is not None

    loads = AsyncLoads(timeout_s=0.3)
    started = time.monotonic()
    loads.submit("req-stuck", load)
    results = loads.poll()
    while not results.finished and time.monotonic() - started < 5.0:
        time.sleep(0.02)
        results = loads.poll()
    took = time.monotonic() - started
    assert results.failed == {"req-stuck"} and 0.3 <= took < 1.0, (results, took)
    assert not read_done.is_set()  # the read is still waiting on the store: only the load was given up
    assert read_done.wait(3.0), "the remote read outlived LMCache's blocking_timeout_secs"
    assert write_tried.wait(1.0) and writes == []  # its late write was refused
    loads.shutdown()


def test_lookup_store_load_and_close_of_an_engine_with_a_stuck_remote_store_are_bounded(
        stuck_redis: StuckServer, monkeypatch: pytest.MonkeyPatch) -> None:
    from lmcache_platforms import ensure_patched

    ensure_patched()
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_LOOKUP_TIMEOUT_S", str(LOOKUP_TIMEOUT_S))
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_CONNECT_TIMEOUT_S", str(CONNECT_TIMEOUT_S))
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_CLOSE_TIMEOUT_S", "1.0")
    spec = load_layout_spec("gemma3")
    layout = materialize(spec, "bundled", seed=5)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens),
                             remote_url=f"redis://127.0.0.1:{stuck_redis.port}")
    request = roundtrip.make_request(layout, spec.num_tokens, 0)
    other = roundtrip.make_request(layout, spec.num_tokens, 1)
    engine = LayoutEngine(layout, storage)
    closed = False
    try:
        engine.engine.config.blocking_timeout_secs = 1  # LMCache's bound on one remote read
        _, took = _timed(lambda: engine.store(request.tokens, request.store_ids))
        assert took < 2.0, f"store took {took:.1f} s"
        deadline = time.monotonic() + 5.0
        while not stuck_redis.connections and time.monotonic() < deadline:  # the remote write connects lazily
            time.sleep(0.02)
        assert stuck_redis.connections, "LMCache never connected to the remote store"

        hit, took = _timed(lambda: engine.lookup(other.tokens))  # not in the CPU cache: the remote is asked
        assert hit == 0  # the first ask on the connection: the connect allowance
        assert CONNECT_TIMEOUT_S * 0.9 < took < CONNECT_TIMEOUT_S + 1.0, f"first lookup took {took:.2f} s"
        hit, took = _timed(lambda: engine.lookup(other.tokens[::-1]))
        assert hit == 0 and took < 0.3, f"lookup while the store is skipped took {took:.2f} s"
        hit, took = _timed(lambda: engine.lookup(request.tokens))  # the CPU cache still serves its chunks
        assert hit == request.stored_tokens and took < 0.3
        # What the connector statistics report: one time-out, then the second lookup's ask answered unasked.
        assert remote_lookup_counts(engine.engine) == (1, 1)

        _a_load_from_the_stuck_store_is_reported_failed_at_the_load_timeout(engine)

        _, took = _timed(engine.close)
        closed = True
        assert took < 6.0, f"closing the engine took {took:.1f} s"
    finally:
        if not closed:
            engine.close()


def test_a_server_with_a_stuck_remote_store_answers_every_request_promptly(
        stuck_redis: StuckServer, tmp_path: Path) -> None:
    """Before the lookup bound, every request waited for LMCache's lookup client to give up (3 s), and the
    whole engine with it; now the first lookup waits ``remote_connect_timeout_s`` (2.5 s), the next ones skip
    the store, and a later probe waits at most ``remote_lookup_timeout_s`` (1 s)."""
    from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
    from lmcache_platforms.tools.demo.runners import Resources
    from lmcache_platforms.tools.demo.scenario import OUR_CONNECTOR
    from lmcache_platforms.tools.demo.server import VllmServer
    from lmcache_platforms.tools.soak import SoakOptions, documents_of, openai_client, soak_serve_args, stream_one

    config = tmp_path / "lmcache.yaml"
    config.write_text(f'chunk_size: 64\nlocal_cpu: true\nmax_local_cpu_size: 0.05\n'
                      f'remote_url: "redis://127.0.0.1:{stuck_redis.port}"\nremote_serde: naive\n')
    kv = {"kv_connector": OUR_CONNECTOR, "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    server = VllmServer.for_model(ensure_model(TINY_MODEL), kv, soak_serve_args(TINY_MODEL.max_model_len),
                                  tmp_path / "server.log", Resources.available(), {"LMCACHE_CONFIG_FILE": str(config)})
    warmup, *prompts = documents_of(SoakOptions(documents=5))
    with server, openai_client(server.base_url, 60.0) as (client, model):
        # The first request pays vLLM's one-time compilation (seconds on a busy CPU) and the connect allowance.
        stream_one(client, model, warmup, 4)
        results = [stream_one(client, model, tokens, 4) for tokens in [*prompts, *prompts]]
        metrics = scrape(server.base_url)
    latencies = sorted(r["latency_s"] for r in results)
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert latencies[-1] < 2.5, latencies
    assert latencies[len(latencies) // 2] < 1.0, latencies
    assert re.search(r"did not answer a lookup [^\n]*within 2.5 s \(platforms.remote_connect_timeout_s\)", log)
    assert [r["cached_tokens"] for r in results[len(prompts):]] == [256] * len(prompts)  # the CPU cache serves
    assert server.exit_code == 0
    # On /metrics: the store timed out (once, or again if a probe after remote_retry_s came within the run) and
    # was skipped since (LMCache asks once per lookup that misses the CPU cache; how many depends on timing).
    assert metrics[f"{PREFIX}remote_lookups_timed_out_total"] >= 1, metrics
    assert metrics[f"{PREFIX}remote_lookups_skipped_total"] >= 1, metrics
