"""The socket reader of Redis loads (``upstream_fixes.redis_socket_reads``) against a real ``redis-server``: each
value lands in its buffer bit for bit, values larger than the reader's own buffer and values dropped unread
included, as the server's user in its database; a reply it cannot use, a connection the server closes or a
store that stops answering is raised and the next read opens a new connection; which connectors it reads for."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio

from lmcache_platforms.tools.redis_server import RedisServer
from lmcache_platforms.upstream_fixes import redis_socket_reads
from lmcache_platforms.upstream_fixes.redis_socket_reads import Endpoint, ReplyError, SocketReader
from tests.ci import missing

pytestmark = pytest.mark.redis

SIZES = (0, 1, 28, 65535, 65536, 65537, 3 * 1024 * 1024 + 5)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[RedisServer]:
    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server)")
    with RedisServer(str(tmp_path)) as started:
        yield started


def _value(size: int, seed: int) -> bytes:
    """``size`` bytes that differ from every shift of themselves and from other seeds' values."""
    return (bytes(range(251)) * (size // 251 + 2))[seed:seed + size]


def _store(client: redis.Redis, objects: dict[str, bytes | None]) -> None:
    for name, value in objects.items():
        client.set(f"{name}metadata", f"meta-{name}".encode())
        if value is not None:
            client.set(f"{name}kv_bytes", value)


def _read(reader: SocketReader, names: list[str], drop: frozenset[int] = frozenset(),
          shift: int = 0) -> tuple[list[redis_socket_reads.Received], dict[int, bytes], list[tuple[int, bytes, int]]]:
    """``reader.read`` with a buffer per object (none for the objects in ``drop``); ``shift`` plants a fault:
    each buffer handed over ``shift`` bytes late."""
    buffers: dict[int, bytearray] = {}
    asked: list[tuple[int, bytes, int]] = []

    def receive(index: int, metadata: bytes, length: int) -> memoryview | None:
        asked.append((index, metadata, length))
        if index in drop:
            return None
        buffers[index] = bytearray(length + shift)
        return memoryview(buffers[index])[shift:]

    received = reader.read(names, receive)
    return received, {index: bytes(buffer[:len(buffer) - shift]) for index, buffer in buffers.items()}, asked


@pytest.mark.parametrize("shift", [0, 1], ids=["reader", "negative-control-shifted-buffer"])
def test_each_value_lands_in_its_buffer_and_a_dropped_one_keeps_the_replies_in_step(server: RedisServer,
                                                                                     shift: int) -> None:
    objects: dict[str, bytes | None] = {f"k{i}": _value(size, i) for i, size in enumerate(SIZES)}
    objects["gone"] = None  # metadata without its bytes
    names = [*objects, "absent"]
    with redis.Redis(port=server.port) as client:
        _store(client, objects)
    reader = SocketReader(Endpoint("127.0.0.1", server.port))
    dropped = frozenset({1, 5})
    received, buffers, asked = _read(reader, names, dropped, shift)
    assert [(r.metadata, r.kv_held) for r in received] == [
        *((f"meta-{n}".encode(), True) for n in names[:len(SIZES)]), (b"meta-gone", False), (None, False)]
    assert asked == [(i, f"meta-k{i}".encode(), size) for i, size in enumerate(SIZES)]
    expected = {i: _value(size, i) for i, size in enumerate(SIZES) if i not in dropped}
    if shift:
        assert buffers != expected
        return
    assert buffers == expected
    assert _read(reader, ["k6"])[1] == {0: _value(SIZES[6], 6)}  # the same connection, still in step


def test_the_store_s_user_and_database_are_used(server: RedisServer) -> None:
    with redis.Redis(port=server.port) as admin:
        admin.execute_command("ACL", "SETUSER", "reader", "on", ">secret", "~*", "+@all")
        admin.config_set("requirepass", "topsecret")
    with redis.Redis(port=server.port, db=3, username="reader", password="secret") as client:
        _store(client, {"x": b"in db 3"})
    endpoint = Endpoint.of(redis.asyncio.Redis.from_url(f"redis://reader:secret@127.0.0.1:{server.port}/3"))
    assert endpoint == Endpoint("127.0.0.1", server.port, db=3, username="reader", password="secret")
    assert _read(SocketReader(endpoint), ["x"])[1] == {0: b"in db 3"}
    with pytest.raises(ReplyError, match=r"^WRONGPASS invalid username-password pair"):
        SocketReader(Endpoint("127.0.0.1", server.port, password="wrong")).read(["x"], lambda *_: None)
    default_user = SocketReader(Endpoint.of(redis.asyncio.Redis.from_url(
        f"redis://:topsecret@127.0.0.1:{server.port}/0")))  # type: ignore[arg-type]
    assert [r.metadata for r in _read(default_user, ["x"])[0]] == [None]  # db 0 holds nothing


def test_an_unusable_reply_or_a_closed_connection_raises_and_the_next_read_reconnects(server: RedisServer) -> None:
    with redis.Redis(port=server.port) as client:
        _store(client, {"a": b"first"})
        client.rpush("listmetadata", b"not a string")
        reader = SocketReader(Endpoint("127.0.0.1", server.port))
        with pytest.raises(ReplyError, match="WRONGTYPE"):
            _read(reader, ["list"])
        assert _read(reader, ["a"])[1] == {0: b"first"}
        client.client_kill_filter(_type="normal", skipme=True)
        with pytest.raises(ConnectionError):
            _read(reader, ["a"])
        assert _read(reader, ["a"])[1] == {0: b"first"}


def test_only_plain_tcp_redis_urls_are_read_by_socket() -> None:
    assert Endpoint.of(redis.asyncio.Redis.from_url("redis://127.0.0.1:7000")) == Endpoint("127.0.0.1", 7000,
                                                                                          timeout_s=5.0)
    assert Endpoint.of(redis.asyncio.Redis.from_url("redis://h:1?socket_timeout=2.5")) == Endpoint("h", 1,
                                                                                               timeout_s=2.5)
    assert Endpoint.of(redis.asyncio.Redis.from_url("rediss://127.0.0.1:7000")) is None
    assert Endpoint.of(redis.asyncio.Redis.from_url("unix:///tmp/redis.sock")) is None


def test_a_reply_line_longer_than_the_read_buffer_is_read_whole() -> None:
    from lmcache_platforms.upstream_fixes.redis_socket_reads import _Replies

    message = b"ERR " + b"x" * 200_000
    left, right = socket.socketpair()
    with left, right:
        right.sendall(b"-" + message + b"\r\n$3\r\nabc\r\n")
        replies = _Replies(left)
        with pytest.raises(ReplyError) as raised:
            replies.bulk_length()
        assert str(raised.value).encode() == message
        assert replies.bulk() == b"abc"


def test_a_store_that_does_not_answer_in_time_raises_a_time_out(server: RedisServer) -> None:
    with redis.Redis(port=server.port) as client:
        _store(client, {"a": b"first"})
    reader = SocketReader(Endpoint("127.0.0.1", server.port, timeout_s=0.3))
    assert _read(reader, ["a"])[1] == {0: b"first"}
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            _read(reader, ["a"])
        assert time.monotonic() - started < 2.0
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
    assert _read(reader, ["a"])[1] == {0: b"first"}
