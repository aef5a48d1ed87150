"""vLLM's OpenAI-compatible server (``vllm serve``) as a child process, the way users run it.

The server runs in its own session (process group) pinned to the demo's cores; it is ready when ``/health``
answers. Stopping it sends SIGINT to its group as Ctrl-C would, waits for vLLM's own shutdown, then kills
whatever of its group is left, so no engine process outlives it. Whether it stopped by itself in time is
recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lmcache_platforms.tools.demo import runners
from lmcache_platforms.tools.demo.runners import (
    GroupLeader,
    PassFailed,
    Resources,
    base_env,
    failure,
    free_port,
    kill_group,
)


def vllm_command() -> str:
    """The ``vllm`` console script of the Python running us (the set-up venv's, or an image's)."""
    return str(Path(sys.executable).with_name("vllm"))


# vLLM's CPU build runs the worker of a one-rank engine in a process of its own (it turns the "uni" executor into
# "mp"); on a GPU that worker runs inside the engine core. Naming the one-process executor by its class keeps the
# GPU's layout (API server + engine core), which is what users of this package run, and saves a third interpreter
# importing vLLM at every server start. The class is vLLM's own; a GPU build picks the same one by default.
IN_CORE_WORKER = ["--distributed-executor-backend", "vllm.v1.executor.uniproc_executor.UniProcExecutor"]
_PARALLEL_FLAGS = ("--distributed-executor-backend", "-tp", "-pp", "-dp")


def runs_one_rank(args: list[str]) -> bool:
    """Whether ``vllm serve`` arguments leave the engine at one rank with vLLM's choice of executor (no tensor,
    pipeline or data parallelism, no executor named)."""
    return not any("parallel-size" in arg or arg.split("=", 1)[0] in _PARALLEL_FLAGS for arg in args)


def serve_command(model_dir: Path, port: int, kv_transfer_config: dict[str, Any] | None,
                  extra_args: list[str]) -> list[str]:
    """``vllm serve MODEL --host 127.0.0.1 --port P [--kv-transfer-config JSON] EXTRA...`` as an argv, with the
    worker inside the engine core where the engine has one rank (``IN_CORE_WORKER``)."""
    command = [vllm_command(), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port)]
    if kv_transfer_config is not None:
        command += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    return command + extra_args + (IN_CORE_WORKER if runs_one_rank(extra_args) else [])


def server_env(resources: Resources, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The passes' environment, but with vLLM's default multiprocess engine (API server + engine core)."""
    env = base_env(resources)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    return {**env, **(extra or {})}


def http_get(url: str, timeout_s: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read().decode()


@dataclass
class VllmServer:
    """One ``vllm serve`` process group; use as a context manager."""

    command: list[str]
    env: dict[str, str]
    log_path: Path
    port: int
    resources: Resources | None = None
    start_timeout_s: float = 600.0
    stop_timeout_s: float = 60.0
    process: GroupLeader | None = None
    exit_code: int | None = None
    stopped_in_time: bool = False
    started_s: float = field(default=0.0)

    @classmethod
    def for_model(cls, model_dir: Path, kv_transfer_config: dict[str, Any] | None, extra_args: list[str],
                  log_path: Path, resources: Resources, extra_env: dict[str, str] | None = None) -> VllmServer:
        port = free_port()
        return cls(serve_command(model_dir, port, kv_transfer_config, extra_args),
                   server_env(resources, extra_env), log_path, port, resources)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _healthy(self) -> bool:
        try:
            http_get(f"{self.base_url}/health", timeout_s=1.0)
        except OSError:
            return False
        return True

    def __enter__(self) -> VllmServer:
        started = time.monotonic()
        self.process = runners.launch(self.command, self.env, self.log_path, self.resources)
        deadline = started + self.start_timeout_s
        while not self._healthy():
            if self.process.poll() is not None:
                self._reap()
                raise failure(f"vllm serve exited (code {self.exit_code}) before it was ready", self.log_path)
            if time.monotonic() > deadline:
                self._reap()
                raise failure(f"vllm serve was not ready within {self.start_timeout_s:.0f} s", self.log_path)
            time.sleep(0.5)
        self.started_s = time.monotonic() - started
        return self

    def __exit__(self, *_exc: object) -> None:
        """SIGINT (vLLM shuts its engine down), then whatever is left of the group is killed."""
        if self.process is None:
            return
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGINT)  # as Ctrl-C does: to the whole foreground group
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=self.stop_timeout_s)
                self.stopped_in_time = True
        self._reap()

    def _reap(self) -> None:
        assert self.process is not None
        if self.process.poll() is not None and self.exit_code is None:
            self.exit_code = self.process.returncode
        kill_group(self.process)
        if self.exit_code is None:
            self.exit_code = self.process.returncode

    def group_alive(self) -> bool:
        """Whether any process of the server's group still exists."""
        if self.process is None:
            return False
        try:
            os.killpg(self.process.pid, 0)
        except ProcessLookupError:
            return False
        return True


def require_vllm_command() -> None:
    """Fail early and clearly when there is no ``vllm`` command next to our Python."""
    if not Path(vllm_command()).is_file():
        raise PassFailed(f"vLLM's command is not at {vllm_command()}: install vLLM into this environment")
