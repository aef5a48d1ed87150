"""A private ``redis-server`` on 127.0.0.1 without persistence, for the Redis tier of benches and tests: started,
stopped and started again on the same port (a store that goes away and comes back)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from types import TracebackType


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def answers_ping(port: int) -> bool:
    """Whether a Redis server answers PING on ``port`` (raw protocol: no client library needed)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """``with RedisServer(directory) as server: server.url``; ``stop``/``start`` keep the port. ``debug``
    allows ``DEBUG`` commands from loopback (tests make the server sleep with ``DEBUG SLEEP``)."""

    def __init__(self, directory: str, binary: str | None = None, start_timeout_s: float = 10.0,
                 debug: bool = False) -> None:
        found = binary or shutil.which("redis-server")
        if found is None:
            raise FileNotFoundError("redis-server is not on PATH (Debian package redis-server)")
        self.binary, self.directory, self.port = found, directory, free_port()
        self.start_timeout_s, self.debug = start_timeout_s, debug
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
             "--dir", self.directory, *(["--enable-debug-command", "local"] if self.debug else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout_s
        while not answers_ping(self.port):
            if self.process.poll() is not None or time.monotonic() > deadline:
                code = self.process.poll()
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start (exit code {code})")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __enter__(self) -> RedisServer:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()
