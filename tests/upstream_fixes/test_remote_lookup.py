"""A slow remote store is slow, not gone: lookups against a real ``redis-server`` made slow with ``DEBUG SLEEP``
(the server answers nothing while it sleeps), behind real LMCache engines over our connector.

The first lookup on a connection gets ``platforms.remote_connect_timeout_s``; after a time-out, lookups skip the
store until its late answer, then for twice its lateness (capped by ``platforms.remote_retry_s``), then ask again.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize
from lmcache_platforms.tools.redis_server import RedisCluster, RedisServer
from tests.ci import missing

pytestmark = [pytest.mark.slow, pytest.mark.redis]

BUDGET_S = 0.3


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    from lmcache_platforms import ensure_patched

    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it)")
    ensure_patched()
    with RedisServer(str(tmp_path), debug=True) as server:
        yield server


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    from lmcache_platforms import ensure_patched

    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        missing("redis-server or redis-cli is not on PATH (Debian package redis-server; scripts/test_services.sh "
                "installs it)")
    ensure_patched()
    with RedisCluster(str(tmp_path), debug=True) as cluster:
        yield cluster


@pytest.fixture
def messages() -> Iterator[list[str]]:
    """What ``upstream_fixes.remote_lookup`` logs (our loggers do not propagate to pytest's)."""
    from lmcache_platforms.upstream_fixes import remote_lookup

    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    remote_lookup.logger.addHandler(handler)
    yield records
    remote_lookup.logger.removeHandler(handler)


@dataclass
class Stored:
    """Chunks one engine stored in the Redis server, for a fresh engine to find."""

    storage: StorageOptions
    layout: object
    request: roundtrip.Request


def _store(server: RedisServer | RedisCluster) -> Stored:
    spec = load_layout_spec("gemma3")
    layout = materialize(spec, "bundled", seed=7)
    request = roundtrip.make_request(layout, spec.num_tokens, seed=7)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens), remote_url=server.url)
    with LayoutEngine(layout, storage) as writer:
        writer.store(request.tokens, request.store_ids)
        assert writer.wait_stored(request.tokens, request.stored_tokens, search_range=["RemoteBackend"]) == \
            request.stored_tokens
    return Stored(storage, layout, request)


class Sleep:
    """``DEBUG SLEEP seconds`` sent to the server from another thread: it answers nothing until ``ended``."""

    def __init__(self, port: int, seconds: float) -> None:
        import redis

        self.client = redis.Redis(host="127.0.0.1", port=port, socket_timeout=seconds + 10)
        self.client.ping()
        self.seconds, self.ended = seconds, 0.0
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._sleep, daemon=True)
        self.thread.start()
        time.sleep(0.1)  # the server has taken the command and sleeps

    def _sleep(self) -> None:
        try:
            self.client.execute_command("DEBUG", "SLEEP", self.seconds)
        except Exception as exc:  # noqa: BLE001 - raised by join, in the test's thread
            self.error = exc
        self.ended = time.monotonic()

    def join(self) -> float:
        self.thread.join(self.seconds + 10)
        self.client.close()
        if self.error is not None:
            raise self.error
        return self.ended


def _timed_lookup(engine: LayoutEngine, tokens: list[int]) -> tuple[int, float, float]:
    started = time.monotonic()
    hit = engine.lookup(tokens)
    return hit, started, time.monotonic() - started


@pytest.mark.parametrize(("connect_s", "hits"), [(4.0, True), (BUDGET_S, False)],
                         ids=["connect-allowance", "negative-control-no-allowance"])
def test_the_first_lookup_on_a_connection_gets_the_connect_allowance(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, connect_s: float, hits: bool) -> None:
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_LOOKUP_TIMEOUT_S", str(BUDGET_S))
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_CONNECT_TIMEOUT_S", str(connect_s))
    stored = _store(redis_server)
    with LayoutEngine(stored.layout, stored.storage) as reader:  # a fresh connection: nothing answered on it yet
        sleep = Sleep(redis_server.port, 1.0)
        hit, _, took = _timed_lookup(reader, stored.request.tokens)
        sleep.join()
        if hits:
            assert hit == stored.request.stored_tokens
            assert 0.7 < took < connect_s, took
            hit, _, took = _timed_lookup(reader, stored.request.tokens)  # answered: the next one has the budget
            assert hit == stored.request.stored_tokens and took < BUDGET_S
        else:
            assert hit == 0
            assert BUDGET_S * 0.9 < took < BUDGET_S + 0.5, took


@pytest.mark.parametrize(("connect_s", "hits"), [(4.0, True), (BUDGET_S, False)],
                         ids=["connect-allowance", "negative-control-no-allowance"])
def test_a_cluster_client_discovering_its_slots_on_a_slow_node_still_hits(
        redis_cluster: RedisCluster, monkeypatch: pytest.MonkeyPatch, connect_s: float, hits: bool) -> None:
    """Issue 25's case: a fresh server's first lookup through ``redis-cluster://`` first asks a start-up node for
    the slot map; that node is slow (asleep for 1 s), and without the allowance the chunks counted as misses."""
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_LOOKUP_TIMEOUT_S", str(BUDGET_S))
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_CONNECT_TIMEOUT_S", str(connect_s))
    stored = _store(redis_cluster)
    with LayoutEngine(stored.layout, stored.storage) as reader:
        sleep = Sleep(redis_cluster.ports[0], 1.0)
        hit, _, took = _timed_lookup(reader, stored.request.tokens)
        sleep.join()
    assert hit == (stored.request.stored_tokens if hits else 0)
    assert (0.7 < took < connect_s) if hits else (BUDGET_S * 0.9 < took < BUDGET_S + 0.5), took


@pytest.mark.parametrize(("retry_s", "capped"), [(30.0, False), (1.0, True)], ids=["proportional", "capped"])
def test_one_time_out_skips_the_store_for_a_time_in_proportion_then_asks_it_again(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch, messages: list[str], retry_s: float,
        capped: bool) -> None:
    import redis

    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_LOOKUP_TIMEOUT_S", str(BUDGET_S))
    monkeypatch.setenv("LMCACHE_PLATFORMS_REMOTE_RETRY_S", str(retry_s))
    stored = _store(redis_server)
    tokens, expected = stored.request.tokens, stored.request.stored_tokens
    with LayoutEngine(stored.layout, stored.storage) as reader:
        assert _timed_lookup(reader, tokens)[0] == expected  # connected
        sleep = Sleep(redis_server.port, 1.2)
        hit, asked, took = _timed_lookup(reader, tokens)
        assert hit == 0 and BUDGET_S * 0.9 < took < BUDGET_S + 0.5, took
        timed_out = asked + took
        lookups = []
        while not lookups or (lookups[-1][0] == 0 and lookups[-1][1] - timed_out < 10.0):
            time.sleep(0.05)
            lookups.append(_timed_lookup(reader, tokens))
        ended = sleep.join()
        with redis.Redis(host="127.0.0.1", port=redis_server.port) as client:  # the store held them throughout
            assert len(client.keys("*metadata")) > 0
        hit, resumed, _ = lookups[-1]
        assert hit == expected
        assert all(h == 0 and t < 0.2 for h, _, t in lookups[:-1]), lookups  # skipped: misses without waiting
        lateness = ended - asked - BUDGET_S
        until = timed_out + retry_s if capped else ended + 2 * lateness
        assert until - 0.1 < resumed < until + 0.6, (resumed - timed_out, until - timed_out, lateness)
        assert resumed - timed_out <= retry_s + 0.6
    skipping = [m for m in messages if "did not answer" in m]
    back = [m for m in messages if "answers lookups in time again" in m]
    assert len(skipping) == 1 and len(back) == 1, messages
    assert f"within {BUDGET_S:.3g} s (platforms.remote_lookup_timeout_s)" in skipping[0]
