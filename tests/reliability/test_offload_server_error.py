"""LMCache's offload server (our ``SafeCloseOffloadServer``) over a real LMCacheEngine: closing it logs no error,
and a request it cannot decode or cannot store is answered, so the server keeps serving.

Upstream's loop answered neither: it logged "Unexpected error in offload server: Expected `object`, got `int`"
for our close's wake-up message, and after any unanswered request its REP socket refused the next ``recv``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import msgspec
import pytest
import zmq

from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions
from lmcache_platforms.tools.fixtures import materialize

pytestmark = pytest.mark.slow


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged() -> Iterator[_Collect]:
    """Records of our loggers (they do not propagate to the root logger)."""
    handler = _Collect()
    logging.getLogger("lmcache_platforms").addHandler(handler)
    yield handler
    logging.getLogger("lmcache_platforms").removeHandler(handler)


@pytest.fixture
def engine() -> Iterator[LayoutEngine]:
    from lmcache_platforms import ensure_patched

    ensure_patched()
    layout = materialize(load_layout_spec("llama"), "bundled", seed=0)
    with LayoutEngine(layout, StorageOptions(max_local_cpu_size=0.05)) as engine:
        engine.engine.metadata.engine_id = f"offload-test-{uuid.uuid4().hex[:8]}"  # a socket path of its own
        yield engine


def _ask(server, payload: bytes) -> bool:
    """One request over a fresh REQ socket, as an offload client sends it; the server's ``success``."""
    from lmcache.v1.offload_server.message import OffloadRetMsg
    from lmcache.v1.rpc_utils import get_zmq_socket

    client = get_zmq_socket(server.ctx, server._socket_path, "ipc", zmq.REQ, "connect")
    try:
        client.setsockopt(zmq.RCVTIMEO, 5000)
        client.send(payload)
        return msgspec.msgpack.decode(client.recv(), type=OffloadRetMsg).success
    finally:
        client.close(linger=0)


def _errors(handler: _Collect) -> list[str]:
    return [r.getMessage() for r in handler.records if r.levelno >= logging.ERROR]


def test_closing_the_offload_server_logs_no_error(engine: LayoutEngine, logged: _Collect,
                                                  capfd: pytest.CaptureFixture[str]) -> None:
    """LMCache's loop logs through a logger it (re)configures when its thread starts, so its lines are read from
    the process's output."""
    from lmcache_platforms.upstream_fixes.offload_server import SafeCloseOffloadServer

    server = SafeCloseOffloadServer(engine.engine, tp_rank=0)
    server.close()
    assert not server.thread.is_alive()
    output = "".join(capfd.readouterr())
    assert "offload server" not in output.lower(), output
    assert _errors(logged) == []


def test_malformed_and_failing_requests_are_answered_and_the_server_keeps_serving(
        engine: LayoutEngine, logged: _Collect) -> None:
    from lmcache.v1.offload_server.message import OffloadMsg

    from lmcache_platforms.upstream_fixes.offload_server import SafeCloseOffloadServer

    server = SafeCloseOffloadServer(engine.engine, tp_rank=0)
    try:
        assert _ask(server, msgspec.msgpack.encode(7)) is False  # decodes to an int, not an OffloadMsg
        # Well-formed, but our GPU connector stores only with per-group block ids: the store raises.
        request = msgspec.msgpack.encode(OffloadMsg(hashes=[1], slot_mapping=list(range(16)), offsets=[16]))
        assert _ask(server, request) is False
        assert _ask(server, b"\xc1") is False  # not msgpack at all
        assert server.thread.is_alive()
    finally:
        server.close()
    messages = [r.getMessage() for r in logged.records]
    assert sum("malformed request" in m for m in messages) == 2, messages
    assert any("storing 1 chunks failed" in m for m in messages), messages
