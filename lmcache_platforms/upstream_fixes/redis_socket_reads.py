"""Redis loads read straight from the socket into LMCache's chunk buffers.

A load through redis-py gets each value as a new ``bytes`` (its reader copies the socket's data into it), which
``redis_reads`` then copies into the chunk's buffer: on one local ``redis-server`` that ran at ~0.55 GB/s, a
plain socket read of the same pipeline at ~1.3 GB/s. For a ``redis://`` store (plain TCP; ``rediss://``, a Unix
socket and a cluster keep redis-py), this module keeps one connection of its own per connector and reads a
load's pipeline (``GET`` of each object's ``metadata`` and ``kv_bytes``) itself: each ``kv_bytes`` reply is
received into the buffer allocated for it, checked against its metadata first as ``redis_reads`` checks it.

Blocking reads, run off the connector's event loop (``asyncio.to_thread``), so lookups and writes go on
meanwhile, each socket operation bounded by the pool's ``socket_timeout`` (redis-py's 5 s unless the URL says).
Any connection or protocol error closes this connection (the next load opens a new one) and is raised; the
caller then reads through redis-py, which reports a store that is down as upstream does, except after a
time-out, which fails the read (LMCache counts it a miss) rather than wait as long again.
"""

from __future__ import annotations

import os
import socket
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

_RECV_BYTES = 1 << 16
_DEFAULT_TIMEOUT_S = 5.0  # redis-py's, where the URL sets no socket_timeout


class ReplyError(Exception):
    """The store answered with an error or a reply a ``GET`` cannot give; the connection is closed."""


@dataclass(frozen=True)
class Endpoint:
    """Where and as whom a ``redis://`` connector's pool connects, and how long a read may wait for the store
    (the pool's ``socket_timeout``)."""

    host: str
    port: int
    db: int = 0
    username: str | None = None
    password: str | None = None
    timeout_s: float = _DEFAULT_TIMEOUT_S

    @classmethod
    def of(cls, client: Any) -> Endpoint | None:
        """The endpoint of a redis-py asyncio client whose pool speaks plain TCP, else None."""
        from redis.asyncio.connection import Connection

        pool = getattr(client, "connection_pool", None)
        if pool is None or pool.connection_class is not Connection:
            return None
        kwargs = pool.connection_kwargs
        return cls(host=kwargs.get("host", "localhost"), port=int(kwargs.get("port", 6379)),
                   db=int(kwargs.get("db", 0) or 0), username=kwargs.get("username"),
                   password=kwargs.get("password"),
                   timeout_s=float(kwargs.get("socket_timeout") or _DEFAULT_TIMEOUT_S))


def _command(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


class _Replies:
    """RESP2 replies read from a blocking socket, a bulk string's body straight into a caller's buffer."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = bytearray(_RECV_BYTES)
        self.start = self.end = 0

    def _fill(self) -> None:
        if self.start == self.end:
            self.start = self.end = 0
        elif self.end == len(self.buffer):
            if self.start == 0:  # one reply line fills the buffer
                self.buffer.extend(bytes(len(self.buffer)))
            else:
                kept = self.end - self.start
                self.buffer[:kept] = self.buffer[self.start:self.end]
                self.start, self.end = 0, kept
        received = self.sock.recv_into(memoryview(self.buffer)[self.end:])
        if received == 0:
            raise ConnectionError("the Redis server closed the connection")
        self.end += received

    def line(self) -> bytes:
        while (at := self.buffer.find(b"\r\n", self.start, self.end)) < 0:
            self._fill()
        line = bytes(self.buffer[self.start:at])
        self.start = at + 2
        return line

    def bulk_length(self) -> int | None:
        """The length of the next reply, a bulk string (None: the null reply of an absent key)."""
        line = self.line()
        if line[:1] == b"$":
            length = int(line[1:])
            return None if length < 0 else length
        if line[:1] == b"-":
            raise ReplyError(line[1:].decode(errors="replace"))
        raise ReplyError(f"expected a bulk string, got {line[:40]!r}")

    def body_into(self, target: memoryview | None, length: int) -> None:
        """The body of a bulk string of ``length`` bytes, into ``target`` (None: read and dropped)."""
        done = 0
        buffered = min(self.end - self.start, length)
        if buffered:
            if target is not None:
                target[:buffered] = memoryview(self.buffer)[self.start:self.start + buffered]
            self.start += buffered
            done = buffered
        while done < length:
            if target is None:
                self._fill()
                taken = min(self.end - self.start, length - done)
                self.start += taken
                done += taken
                continue
            received = self.sock.recv_into(target[done:length])
            if received == 0:
                raise ConnectionError("the Redis server closed the connection")
            done += received
        if self.line() != b"":
            raise ReplyError("a bulk string longer than its length")

    def bulk(self) -> bytes | None:
        length = self.bulk_length()
        if length is None:
            return None
        body = bytearray(length)
        self.body_into(memoryview(body), length)
        return bytes(body)


@dataclass(frozen=True)
class Received:
    """Per object of a load: its ``metadata`` value (None: absent) and whether its ``kv_bytes`` was there."""

    metadata: bytes | None
    kv_held: bool


Receiver = Callable[[int, bytes, int], memoryview | None]


@dataclass
class SocketReader:
    """One connector's own connection to its ``redis://`` store, opened at the first load."""

    endpoint: Endpoint
    lock: threading.Lock = field(default_factory=threading.Lock)
    _replies: _Replies | None = None
    _close: weakref.finalize | None = None  # closes the open socket, at the latest when the reader goes
    _pid: int = 0

    def _connect(self) -> _Replies:
        if self._replies is not None and self._pid == os.getpid():
            return self._replies
        self._drop()  # in a forked child: its copy of the parent's socket (the parent's stays open)
        sock = socket.create_connection((self.endpoint.host, self.endpoint.port), timeout=self.endpoint.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        replies = _Replies(sock)
        setup = []
        if self.endpoint.password is not None:
            auth = [b"AUTH"] + ([self.endpoint.username.encode()] if self.endpoint.username else [])
            setup.append(_command(*auth, self.endpoint.password.encode()))
        if self.endpoint.db:
            setup.append(_command(b"SELECT", str(self.endpoint.db).encode()))
        try:
            if setup:
                sock.sendall(b"".join(setup))
                for _ in setup:
                    if (answer := replies.line()) != b"+OK":
                        raise ReplyError(answer.removeprefix(b"-").decode(errors="replace"))
        except BaseException:
            sock.close()
            raise
        self._close, self._replies, self._pid = weakref.finalize(self, sock.close), replies, os.getpid()
        return replies

    def _drop(self) -> None:
        if self._close is not None:
            self._close()
        self._close = self._replies = None

    def read(self, names: list[str], receive: Receiver) -> list[Received]:
        """Both values of each object, in one pipeline. For an object whose ``metadata`` and ``kv_bytes`` are
        both held, ``receive(index, metadata, length)`` gives the buffer to read its ``length`` bytes into (None:
        read and dropped). A buffer ``receive`` gave is the caller's even when this raises (it is listed in the
        ``receive`` calls made)."""
        with self.lock:
            try:
                replies = self._connect()
                replies.sock.sendall(b"".join(_command(b"GET", f"{name}{suffix}".encode())
                                            for name in names for suffix in ("metadata", "kv_bytes")))
                received = []
                for index in range(len(names)):
                    metadata = replies.bulk()
                    length = replies.bulk_length()
                    target = None if metadata is None or length is None else receive(index, metadata, length)
                    if length is not None:
                        replies.body_into(target, length)
                    received.append(Received(metadata, length is not None))
                return received
            except BaseException:
                self._drop()
                raise


_READER = "_lmcache_platforms_socket_reader"


def reader_of(connector: Any) -> SocketReader | None:
    """The socket reader of LMCache's ``redis://`` connector (made at its first load), None for any other
    connector or a connection redis-py makes other than over plain TCP."""
    reader = getattr(connector, _READER, None)
    if reader is not None:
        return reader
    from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

    if not isinstance(connector, RedisConnector) or (endpoint := Endpoint.of(connector.connection)) is None:
        return None
    reader = SocketReader(endpoint)
    setattr(connector, _READER, reader)
    return reader
