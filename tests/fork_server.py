"""A fork server for test scripts and modules that must each start with a fresh import state of vLLM and LMCache.

A fresh interpreter that builds a vLLM engine or imports vLLM's connector factory spends 6-7 s importing torch,
transformers and vLLM's config modules before anything a test is about. This server imports those once, checks
that nothing of LMCache, of ours or of vLLM's KV-transfer package came with them, then forks one child per run:
each child starts from exactly that state, as a fresh interpreter would after those imports, with the run's
environment, working folder and ``PYTHONPATH``, and ends as an interpreter does (threads joined, ``atexit``
handlers run), so a run that would hang at exit still hangs here (and meets its time limit); only the module
teardown after that is skipped (about 2 s of garbage collection per run with vLLM loaded).

A run that builds an engine and tests nothing about import order can ask for a second server that preloaded the
rest of vLLM's engine too (``engine=True``: a few seconds fewer per run; vLLM's KV-transfer package is loaded
then, LMCache and our package still are not).

A run whose ``PYTHONPATH`` shadows a preloaded package (another vLLM: ``tests/integration/test_vllm023.py``)
cannot start from this state and keeps its own interpreter.

The server is run as ``python -c <this file's source>`` (``sys.path`` then starts with the working folder, as
for ``python -c`` and ``python -m``); one JSON request a line on stdin, the child's pid a line on stdout. Children
run at once, each writing its exit status to a file when it ends. ``run_module`` and ``run_script`` are the
client side (one server per test process, started on first use).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any

PRELOADED = ("torch", "transformers", "vllm.config", "vllm.engine.arg_utils")
# What the runs import themselves, each in its own order: none of it may be loaded before a run starts.
UNTOUCHED = ("lmcache", "vllm.distributed.kv_transfer")
ENGINE_PRELOADED = (*PRELOADED, "vllm.entrypoints.llm", "vllm.v1.engine.llm_engine", "vllm.v1.worker.cpu_worker")
"""For runs whose import order is not what they test (an engine built as a script builds it): the rest of vLLM's
engine too, vLLM's KV-transfer package with it; LMCache and our package still untouched."""
ENGINE_UNTOUCHED = ("lmcache",)
# Left out of the server's own environment: they must act only where a run sets them.
RUN_ONLY = ("LMCACHE_PLATFORMS_DISABLE", "VLLM_PLUGINS")


def clean_environment(**env: str) -> dict[str, str]:
    """This process's environment without the run-only switches, with a fixed hash seed and no usage tracking, and
    ``env`` on top: the server's own environment, and a run's base."""
    environ = {k: v for k, v in os.environ.items() if k not in RUN_ONLY}
    environ.update(PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false", **env)
    return environ


def _child(request: dict[str, Any]) -> None:
    """In the forked child: set the run up, run it, and leave (``_leave``)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(os.open(request.get("stdin", os.devnull), os.O_RDONLY), 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    code = 1
    try:
        if "module" in request:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c"]
            exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # noqa: BLE001 - any failure is the run's: on its stderr, a non-zero status
        traceback.print_exc()
    _leave(code, request["status"])


def _leave(code: int, status: str) -> None:
    """End the child as an interpreter ends: its threads joined, then its exit handlers run (a run that hangs
    there hangs here); then the status is written and the process leaves without tearing its modules down, the
    seconds of garbage collection an interpreter holding torch and vLLM spends at exit, which no run observes."""
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's own first exit step
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    Path(status + ".part").write_text(str(code))
    os.rename(status + ".part", status)
    os._exit(code)


def serve(engine: bool) -> None:
    for name in ENGINE_PRELOADED if engine else PRELOADED:
        importlib.import_module(name)
    loaded = sorted(name for name in sys.modules if name.startswith(ENGINE_UNTOUCHED if engine else UNTOUCHED))
    print(json.dumps({"loaded": loaded}), flush=True)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children are reaped as they end
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)


class ForkServer:
    """The client: ``run`` gives what ``subprocess.run`` of a fresh interpreter would, from a forked child."""

    def __init__(self, engine: bool = False) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="fork-server-"))
        env = clean_environment()
        argv = [sys.executable, "-c", Path(__file__).read_text(), *(["engine"] if engine else [])]
        with open(self._folder / "server.err", "w") as errors:
            self._process = subprocess.Popen(argv, env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                             stderr=errors)
        self._lock = threading.Lock()
        self._count = 0
        ready = self._answer()
        assert ready["loaded"] == [], f"the preloaded modules imported what the runs must import: {ready}"

    def _answer(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        assert line, f"the fork server died: {(self._folder / 'server.err').read_text()[-3000:]}"
        return json.loads(line)

    def run(self, what: dict[str, Any], env: Mapping[str, str], cwd: Path | str | None = None,
            timeout: float = 600.0, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``what`` is ``{"module": name, "argv": [...]}`` (``python -m``) or ``{"script": source}`` (``-c``);
        ``input`` is the run's stdin (default: empty)."""
        assert self._process.stdin is not None
        with self._lock:
            self._count += 1
            parts = ("out", "err", "status", "in")
            out, err, status, given = (self._folder / f"{self._count}.{part}" for part in parts)
            request = {**what, "env": dict(env), "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                       "stderr": str(err), "status": str(status)}
            if input is not None:
                given.write_text(input)
                request["stdin"] = str(given)
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            pid = self._answer()["pid"]
        deadline = time.monotonic() + timeout
        while _alive(pid):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                raise subprocess.TimeoutExpired(str(what)[:200], timeout, out.read_text(), err.read_text())
            time.sleep(0.05)
        code = int(status.read_text()) if status.exists() else -1  # none: killed before it could say
        done = subprocess.CompletedProcess([str(what)[:200]], code, out.read_text(), err.read_text())
        for path in (out, err, status, given):
            path.unlink(missing_ok=True)
        return done

    def close(self) -> None:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.close()
        self._process.wait(timeout=60)
        self._process.stdout.close()
        for path in self._folder.iterdir():
            path.unlink()
        self._folder.rmdir()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


_shared: dict[bool, ForkServer] = {}
_shared_lock = threading.Lock()


def shared(engine: bool = False) -> ForkServer:
    """This test process's server (with vLLM's engine preloaded or not), started on first use, closed at exit."""
    with _shared_lock:
        if engine not in _shared:
            _shared[engine] = server = ForkServer(engine)
            atexit.register(server.close)
        return _shared[engine]


def run_module(module: str, argv: list[str], env: Mapping[str, str], cwd: Path | str | None = None,
               timeout: float = 600.0, input: str | None = None,
               engine: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m module *argv`` with ``env`` in ``cwd``, as a child of this process's fork server; ``engine``:
    of the server that preloaded vLLM's engine (``ENGINE_PRELOADED``)."""
    return shared(engine).run({"module": module, "argv": argv}, env, cwd, timeout, input)


def run_script(script: str, env: Mapping[str, str], timeout: float = 600.0, cwd: Path | str | None = None,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c script`` with ``env`` in ``cwd``, as a child of this process's fork server."""
    return shared().run({"script": script}, env, cwd, timeout, input)


if __name__ == "__main__":
    serve(sys.argv[1:] == ["engine"])
