"""A private ``redis-server`` on 127.0.0.1 without persistence, for the Redis tier of benches and tests: started,
stopped and started again on the same port (a store that goes away and comes back); and a local Redis Cluster
of such servers, the store several vLLM servers share."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path
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


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports nothing listens on now (held open together while the OS picks them)."""
    socks = [socket.socket() for _ in range(count)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return [int(sock.getsockname()[1]) for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class RedisCluster:
    """A local Redis Cluster of ``masters`` masters and no replicas, from Debian's ``redis-server`` and
    ``redis-cli``: ``with RedisCluster(directory) as cluster: cluster.url`` (LMCache's ``redis-cluster://``).

    Each node gets a free port and a free cluster-bus port (``cluster-port``; the default, port + 10000, may be
    taken or past 65535); ``redis-cli --cluster create`` assigns the slots, and ``start`` returns once every node's
    ``cluster info`` says ``cluster_state:ok``. ``debug`` allows ``DEBUG`` commands from loopback, as for
    ``RedisServer``."""

    def __init__(self, directory: str, masters: int = 3, start_timeout_s: float = 30.0, debug: bool = False) -> None:
        server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
        if server is None or cli is None:
            raise FileNotFoundError("redis-server or redis-cli is not on PATH (Debian package redis-server)")
        self.server, self.cli, self.directory = server, cli, Path(directory)
        ports = free_ports(2 * masters)
        self.ports, self.bus_ports = ports[:masters], ports[masters:]
        self.start_timeout_s, self.debug = start_timeout_s, debug
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def url(self) -> str:
        return "redis-cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        for node in range(len(self.ports)):
            self.processes.append(self._launch(node))  # one by one, so that stop() sees each started node
        for node in range(len(self.ports)):
            self._wait_answering(node, deadline)
        create = subprocess.run(
            [self.cli, "--cluster", "create", *(f"127.0.0.1:{port}" for port in self.ports), "--cluster-replicas",
             "0", "--cluster-yes"], capture_output=True, text=True, timeout=max(deadline - time.monotonic(), 1.0))
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {create.stdout[-2000:]}{create.stderr[-2000:]}")
        self._wait_ok(deadline)

    def _launch(self, node: int) -> subprocess.Popen[bytes]:
        port = self.ports[node]
        node_dir = self.directory / f"node-{port}"
        node_dir.mkdir(parents=True, exist_ok=True)
        return subprocess.Popen(
            [self.server, "--bind", "127.0.0.1", "--port", str(port), "--cluster-enabled", "yes",
             "--cluster-port", str(self.bus_ports[node]), "--cluster-config-file", "nodes.conf", "--save", "",
             "--appendonly", "no", "--dir", str(node_dir),
             *(["--enable-debug-command", "local"] if self.debug else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)

    def _wait_answering(self, node: int, deadline: float) -> None:
        port, process = self.ports[node], self.processes[node]
        while not answers_ping(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"cluster node on port {port} did not start (exit code {process.poll()})")
            time.sleep(0.05)

    def _wait_ok(self, deadline: float) -> None:
        while not all(self.state(port) == "ok" for port in self.ports):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster on ports {self.ports} did not reach cluster_state:ok")
            time.sleep(0.1)

    def restart(self, node: int) -> None:
        """Stop node ``node`` (SIGTERM) and start it again on its ports: it keeps its slots (its ``nodes.conf``)
        and loses every key it held (nothing is saved); returns once the cluster is ``ok`` again."""
        _stop_node(self.processes[node])
        deadline = time.monotonic() + self.start_timeout_s
        self.processes[node] = self._launch(node)
        self._wait_answering(node, deadline)
        self._wait_ok(deadline)

    def state(self, port: int) -> str:
        """``cluster_state`` of the node on ``port`` (``ok``, ``fail``), empty if it does not answer."""
        info = subprocess.run([self.cli, "-h", "127.0.0.1", "-p", str(port), "cluster", "info"],
                              capture_output=True, text=True, timeout=5)
        for line in info.stdout.splitlines():
            if line.startswith("cluster_state:"):
                return line.split(":", 1)[1].strip()
        return ""

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            _stop_node(process)
        self.processes = []

    def __enter__(self) -> RedisCluster:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


def _stop_node(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (if still running), then SIGKILL after 10 s; reaped."""
    if process.poll() is None:
        process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
