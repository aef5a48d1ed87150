"""Runs engine passes as subprocesses pinned to the same cores, and LMCache's separate server when compared.

Why subprocesses: a pass must start from a fresh engine (vLLM's own prefix cache empty), and an engine with
LMCache in it must not be able to hang the demo at exit. Each pass gets its own session (process group): when
it ends, or runs past its time limit, whatever it left behind is killed, so no stray process outlives it.
Every process is pinned to the same CPU set and vLLM is given that set explicitly, because vLLM's automatic
binding reserves a core when a connector is configured and would compare configurations on unequal CPUs.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

Progress = Callable[[str], None]
ENGINE_PASS_MODULE = "lmcache_platforms.tools.demo.engine_pass"


class PassFailed(RuntimeError):
    """A pass or the LMCache server did not finish; the message ends with the tail of its log."""


@dataclass(frozen=True)
class Resources:
    """The CPUs every process of the demo runs on, and vLLM's KV-cache size (GiB)."""

    cores: tuple[int, ...]
    kv_cache_gib: int = 1

    @classmethod
    def available(cls) -> Resources:
        return cls(tuple(sorted(os.sched_getaffinity(0))))

    def cpu_list(self) -> str:
        return ",".join(str(core) for core in self.cores)

    def pin(self) -> None:
        """Runs in the child between fork and exec."""
        os.sched_setaffinity(0, self.cores)


def base_env(resources: Resources) -> dict[str, str]:
    """Environment every pass needs: one process per engine, stable token hashing, explicit CPU binding."""
    env = dict(os.environ)
    env.update({
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "PYTHONHASHSEED": "0",
        "VLLM_CPU_KVCACHE_SPACE": str(resources.kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": resources.cpu_list(),
        "LMCACHE_TRACK_USAGE": "false",
        "TOKENIZERS_PARALLELISM": "false",
    })
    # The demo reads LMCache's and our INFO lines (KV-cache groups, hits): a quieter level inherited from the
    # caller would hide them; a more verbose one is kept.
    if env.get("LMCACHE_LOG_LEVEL", "INFO").upper() not in {"DEBUG", "INFO"}:
        env["LMCACHE_LOG_LEVEL"] = "INFO"
    # LMCache sets this to one fixed folder in any process that builds an engine (a test runner, a bench); a
    # server inheriting it would add every earlier server's metric files to its own /metrics.
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    return env


def _log_tail(path: Path, lines: int = 25) -> str:
    if not path.exists():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


_LOG_STAMP = re.compile(r"\[\d{4}-\d\d-\d\d ")  # another process's log line glued onto the error
_LOG_PREFIX = re.compile(r"^.*?\d\d:\d\d:\d\d[,.]\d+\]\s*")  # "[date time] " of a log line


def _last_error(path: Path) -> str:
    """The last ``SomeError: message`` line of a log (a traceback's conclusion), or an empty string."""
    if not path.exists():
        return ""
    for line in reversed(path.read_text(errors="replace").splitlines()):
        text = line.split("]: ", 1)[-1].strip()
        head = text.split(":", 1)[0]
        if ":" in text and head.endswith(("Error", "Exception", "Interrupt")) and " " not in head:
            return _LOG_STAMP.split(text, 1)[0].strip()
    return ""


DEGRADED_MARKERS = ("DEGRADED MODE", "entering degraded mode", "Failed to initialize/re-establish remote")


def log_warnings(path: Path, markers: tuple[str, ...] = DEGRADED_MARKERS) -> list[str]:
    """Lines of a pass's log that explain a run without hits (LMCache fell back to recomputing)."""
    if not path.exists():
        return []
    lines = path.read_text(errors="replace").splitlines()
    return sorted({_LOG_PREFIX.sub("", line).strip() for line in lines if any(m in line for m in markers)})


def failure(what: str, log_path: Path) -> PassFailed:
    error = _last_error(log_path)
    return PassFailed(f"{what}{': ' + error if error else ''}\nlog {log_path}:\n{_log_tail(log_path)}")


class GroupLeader(Protocol):
    """What is used of a child that leads its own process group (``subprocess.Popen`` has it)."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


def start_fresh(command: list[str], env: dict[str, str], log_path: Path,
                resources: Resources | None) -> GroupLeader:
    """``command`` as a fresh process leading its own session (process group), pinned to ``resources``' cores,
    its stdout and stderr in ``log_path``, stdin empty: how users start ``vllm serve`` or a script."""
    with log_path.open("w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True, preexec_fn=resources.pin if resources else None)


Launch = Callable[[list[str], dict[str, str], Path, "Resources | None"], GroupLeader]
# How the tools start a server or an engine pass (``VllmServer``, ``PassRunner``), read at each start. The test
# suite replaces it for the session (tests/fork_launch.py): a ``vllm serve`` or a ``python -m`` pass becomes a
# child of an interpreter that imported vLLM's CLI, or torch and vLLM's config, once, saving the seconds each
# fresh interpreter spends importing them; the session, the cores and the code run from the entry point on are
# those of the fresh process.
launch: Launch = start_fresh


def kill_group(process: GroupLeader, settle_s: float = 5.0) -> None:
    """Kill the process group the child leads (it and anything it started), reap the child, and wait (boundedly)
    until the group is gone: SIGKILL is asynchronous, and a caller checking for strays must not see the dying."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)


def status_kib(field: str, pid: int | str = "self") -> int | None:
    """A memory line of ``/proc/PID/status`` in KiB (``VmRSS``: resident now; ``VmHWM``: the most resident since
    the start or the last reset of the peak), None where the file has no such line."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    return None


@dataclass
class _Relay:
    """Forwards new lines of a pass's progress file."""

    path: Path
    progress: Progress
    prefix: str
    offset: int = 0

    def poll(self) -> None:
        if not self.path.exists():
            return
        with self.path.open() as f:
            f.seek(self.offset)
            text = f.read()
        complete, _, _rest = text.rpartition("\n")
        if complete:
            self.offset += len(complete) + 1
            for line in complete.splitlines():
                self.progress(f"{self.prefix}{line}")


@dataclass
class PassRunner:
    """Runs engine passes in ``workdir`` (specs, results, logs) with the given resources."""

    workdir: Path
    resources: Resources
    progress: Progress
    timeout_s: float = 600.0
    exit_grace_s: float = 30.0
    logs: list[Path] = field(default_factory=list)

    def run(self, label: str, spec: dict[str, Any], extra_env: dict[str, str] | None = None,
            module: str = ENGINE_PASS_MODULE) -> dict[str, Any]:
        """One engine pass (``python -m module SPEC OUT``): its result dict, or PassFailed with the log's tail."""
        stem = self.workdir / label
        spec_path, out_path, log_path = (stem.with_suffix(s) for s in (".spec.json", ".out.json", ".log"))
        progress_path = stem.with_suffix(".progress")
        for path in (out_path, progress_path):
            path.unlink(missing_ok=True)
        spec_path.write_text(json.dumps({**spec, "progress_file": str(progress_path)}))
        env = {**base_env(self.resources), **(extra_env or {})}
        relay = _Relay(progress_path, self.progress, f"  [{label}] ")
        self.logs.append(log_path)
        process = launch([sys.executable, "-m", module, str(spec_path), str(out_path)], env, log_path,
                         self.resources)
        hung = self._wait(process, out_path, log_path, label, relay)
        if not hung and (process.returncode != 0 or not out_path.exists()):
            raise failure(f"pass {label} failed (exit {process.returncode})", log_path)
        result = json.loads(out_path.read_text())
        result["warnings"] = log_warnings(log_path)
        if hung:
            result["warnings"].append(f"pass {label} had written its results but did not exit within "
                                      f"{self.exit_grace_s:.0f} s (hung at exit); it was killed")
        return result

    def _wait(self, process: GroupLeader, out_path: Path, log_path: Path, label: str, relay: _Relay) -> bool:
        """Wait for the pass; True when it wrote its results but then hung at exit and had to be killed."""
        deadline = time.monotonic() + self.timeout_s
        finished_at: float | None = None
        try:
            while process.poll() is None:
                relay.poll()
                now = time.monotonic()
                if finished_at is None and out_path.exists():
                    finished_at = now
                if finished_at is not None and now - finished_at > self.exit_grace_s:
                    return True
                if now > deadline:
                    raise failure(f"pass {label} ran past {self.timeout_s:.0f} s", log_path)
                time.sleep(0.2)
            return False
        finally:
            kill_group(process)
            relay.poll()


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it), so a demo never talks to someone else's server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("localhost", 0))
        return probe.getsockname()[1]


def free_port_run(count: int) -> int:
    """A port P such that P .. P + count - 1 are free on every interface now, below the OS's range of ephemeral
    ports: for a server that binds P + i itself later (vLLM's KV-event publisher of data-parallel rank i, LMCache's
    internal API servers), so that no connection opened meanwhile (its local port is an ephemeral one) can take
    one of them first."""
    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    first_ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 32768
    while True:
        port = random.randrange(20_000, first_ephemeral - count)
        try:
            for offset in range(count):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                    probe.bind(("", port + offset))
        except OSError:
            continue
        return port


@dataclass
class LMCacheServer:
    """LMCache's separate server (``lmcache server``), pinned like the passes, for the comparison."""

    workdir: Path
    resources: Resources
    chunk_size: int
    port: int = field(default_factory=free_port)
    http_port: int = field(default_factory=free_port)
    l1_size_gb: float = 2.0
    start_timeout_s: float = 120.0
    process: subprocess.Popen | None = None

    @property
    def log_path(self) -> Path:
        return self.workdir / "lmcache_server.log"

    def command(self) -> list[str]:
        script = Path(sys.executable).with_name("lmcache")
        return [
            str(script), "server", "--host", "localhost", "--port", str(self.port),
            "--http-host", "localhost", "--http-port", str(self.http_port),
            "--chunk-size", str(self.chunk_size), "--l1-size-gb", str(self.l1_size_gb),
            "--eviction-policy", "LRU", "--supported-transfer-mode", "lmcache_driven",
        ]

    def kv_transfer_config(self) -> dict[str, Any]:
        return {
            "kv_connector": "LMCacheMPConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port},
        }

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://localhost:{self.http_port}/", timeout=1.0) as reply:
                return reply.status == 200
        except OSError:
            return False

    def __enter__(self) -> LMCacheServer:
        script = self.command()[0]
        if not Path(script).is_file():
            raise PassFailed(f"lmcache server cannot run: LMCache's command-line tool is not at {script}")
        env = base_env(self.resources)
        with self.log_path.open("w") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                start_new_session=True, preexec_fn=self.resources.pin,
            )
        deadline = time.monotonic() + self.start_timeout_s
        while self.process.poll() is not None or not self._ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise failure("lmcache server did not start", self.log_path)
            time.sleep(0.5)
        return self

    def __exit__(self, *_exc: object) -> None:
        """Ask the server to stop (SIGINT, as Ctrl-C would), then kill its group whatever happened."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=15)
        kill_group(self.process)
        self.process = None
