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

The servers and engine passes the tools start (``lmcache_platforms.tools.demo.runners.launch``, replaced for the
session by ``tests/fork_launch.py``) are children too: a ``vllm serve`` of a third server, which preloaded vLLM's
CLI and OpenAI server (``SERVE_PRELOADED``: what a fresh ``vllm serve`` imports before it reads its arguments,
LMCache and our package not among it), a ``python -m`` pass of the first. A server child asked for a ``zygote``
forks one before it runs (``tests/spawn_zygote.py``), from which its spawned processes are forked. Such a child
leads its own session and runs on the cores it was given, as ``subprocess.Popen`` with ``start_new_session`` would
start it; ``start`` returns it at once (``ForkedChild``).

Every server also compiles vLLM's sampler op before it forks, which each engine would otherwise compile on its
first request for logprobs (``tests/warm_sampler.py``), and then freezes what it holds out of the garbage
collector's reach (``gc.freeze``): vLLM runs full collections while it builds and stops an engine, ~0.27 s each
with torch, transformers and vLLM loaded, ~2.4 s a pass; a child's collections then walk only what it created.
Those objects stay alive, as they would in a fresh interpreter, where modules are never collected either.

A run whose ``PYTHONPATH`` shadows a preloaded package (another vLLM: ``tests/integration/test_vllm023.py``)
cannot start from this state and keeps its own interpreter.

The server is run as ``python -c <this file's source>`` (``sys.path`` then starts with the working folder, as
for ``python -c`` and ``python -m``); one JSON request a line on stdin, the child's pid a line on stdout. Children
run at once, each writing its exit status to a file when it ends. ``run_module`` and ``run_script`` are the
client side (one server per test process, started on first use).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import importlib.util
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
SERVE_PRELOADED = (*PRELOADED, "vllm.entrypoints.cli.main", "vllm.entrypoints.cli.serve",
                   "vllm.entrypoints.openai.api_server")
"""What ``vllm serve`` imports before it reads its arguments (its own KV-transfer package among it)."""
_zygote: Any = None  # tests/spawn_zygote.py, in a server of kind "serve"
KINDS = {"plain": (PRELOADED, UNTOUCHED), "engine": (ENGINE_PRELOADED, ENGINE_UNTOUCHED),
         "serve": (SERVE_PRELOADED, ENGINE_UNTOUCHED)}
# Left out of the server's own environment: they must act only where a run sets them. LMCache sets
# PROMETHEUS_MULTIPROC_DIR in any process that builds an engine (a test worker, once one ran in it), and
# prometheus_client, which the preloads import, picks its value class by it at import.
RUN_ONLY = ("LMCACHE_PLATFORMS_DISABLE", "VLLM_PLUGINS", "PROMETHEUS_MULTIPROC_DIR")


def clean_environment(**env: str) -> dict[str, str]:
    """This process's environment without the run-only switches, with a fixed hash seed and no usage tracking, and
    ``env`` on top: the server's own environment, and a run's base."""
    environ = {k: v for k, v in os.environ.items() if k not in RUN_ONLY}
    environ.update(PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false", **env)
    return environ


def _child(request: dict[str, Any]) -> None:
    """In the forked child: set the run up, run it, and leave (``_leave``)."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    if request.get("session"):
        os.setsid()
    if request.get("cpus"):
        os.sched_setaffinity(0, request["cpus"])
    if request.get("title"):  # what a fresh process's command line would show (a stray is found by it)
        import setproctitle

        setproctitle.setproctitle(request["title"])
    os.dup2(os.open(request.get("stdin", os.devnull), os.O_RDONLY), 0)
    os.dup2(os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
    if request["stderr"] == request["stdout"]:
        os.dup2(1, 2)
    else:
        os.dup2(os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
    _adopt_environment(request["env"])
    os.chdir(request["cwd"])
    extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
    sys.path[1:1] = extra
    if request.get("zygote"):
        _zygote.start(Path(request["status"]).parent, _leave, _reap, _adopt_environment)
    code = 1
    try:
        if "module" in request:
            sys.argv = [request["module"], *request["argv"]]
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        else:
            sys.argv = request.get("sys_argv", ["-c"])
            exec(compile(request["script"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception:  # noqa: BLE001 - any failure is the run's: on its stderr, a non-zero status
        traceback.print_exc()
    _leave(code, request["status"])


def _adopt_environment(env: dict[str, str]) -> None:
    """Take ``env`` as this process's whole environment, as a fresh interpreter started with it would."""
    os.environ.clear()
    os.environ.update(env)
    if "prometheus_client.values" in sys.modules:  # the value class a fresh import would pick in this environment
        values = sys.modules["prometheus_client.values"]
        values.ValueClass = values.get_value_class()  # type: ignore[attr-defined]


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


def _load(folder: str, name: str) -> Any:
    """A module of ``folder`` by its path (this server runs as ``python -c``; ``tests`` is no package to it)."""
    spec = importlib.util.spec_from_file_location(name, Path(folder) / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def serve(kind: str, folder: str) -> None:
    global _zygote
    preloaded, untouched = KINDS[kind]
    if kind == "serve":  # its children fork a zygote for what vLLM spawns (tests/spawn_zygote.py)
        _zygote = _load(folder, "spawn_zygote")
    for name in preloaded:
        importlib.import_module(name)
    _load(folder, "warm_sampler").warm()
    loaded = sorted(name for name in sys.modules if name.startswith(untouched))
    print(json.dumps({"loaded": loaded}), flush=True)
    gc.freeze()  # what it loaded is never garbage: the children's collections skip it
    children: dict[int, str] = {}
    signal.signal(signal.SIGCHLD, lambda *_: _reap(children))
    for line in sys.stdin:
        request = json.loads(line)
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reaped only once it is known
        pid = os.fork()
        if pid == 0:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            _child(request)
        children[pid] = request["status"]
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        print(json.dumps({"pid": pid}), flush=True)


def _reap(children: dict[int, str]) -> None:
    """Reap the children that ended; one a signal killed gets the status ``subprocess`` gives it (minus the
    signal's number), written before it is reaped, so a caller seeing it gone also sees its status."""
    while True:
        try:
            ended = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # none left
            return
        if ended is None:  # none ended
            return
        status = children.pop(ended.si_pid, None)
        if status and ended.si_code in (os.CLD_KILLED, os.CLD_DUMPED) and not os.path.exists(status):
            Path(status + ".part").write_text(str(-ended.si_status))
            os.rename(status + ".part", status)
        os.waitpid(ended.si_pid, 0)


class ForkedChild:
    """A started child of a fork server, as far as callers use a ``subprocess.Popen``: its pid, ``poll`` and
    ``wait``. The server reaps its children itself; the status is what the child wrote as it left, or -1 when it
    left without writing one (killed, or by ``os._exit``)."""

    def __init__(self, pid: int, status: Path, paths: tuple[Path, ...]) -> None:
        self.pid = pid
        self.returncode: int | None = None
        self._status = status
        self._paths = paths

    def poll(self) -> int | None:
        from tests.spawn_zygote import alive  # here, not at the top: the server runs this file as ``-c`` source

        if self.returncode is None and not alive(self.pid):
            self.returncode = int(self._status.read_text()) if self._status.exists() else -1
            for path in self._paths:
                path.unlink(missing_ok=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            time.sleep(0.05)
        return code


class ForkServer:
    """The client: ``run`` gives what ``subprocess.run`` of a fresh interpreter would, from a forked child;
    ``start`` what ``subprocess.Popen`` would."""

    def __init__(self, kind: str = "plain") -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="fork-server-"))
        env = clean_environment()
        argv = [sys.executable, "-c", Path(__file__).read_text(), kind, str(Path(__file__).parent)]
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

    def _fork(self, request: dict[str, Any]) -> int:
        assert self._process.stdin is not None
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        return self._answer()["pid"]

    def start(self, what: dict[str, Any], command: list[str], env: Mapping[str, str], cwd: Path | str, log: Path,
              cpus: tuple[int, ...] = ()) -> ForkedChild:
        """``what`` as in ``run``, standing for the fresh process ``command`` (its command line shows that),
        started in a session of its own on ``cpus`` (all if none), stdout and stderr into ``log``, stdin empty;
        returned at once."""
        with self._lock:
            self._count += 1
            status = self._folder / f"{self._count}.status"
            pid = self._fork({**what, "env": dict(env), "cwd": str(cwd), "stdout": str(log), "stderr": str(log),
                              "status": str(status), "session": True, "cpus": list(cpus),
                              "title": " ".join(command)})
        return ForkedChild(pid, status, (status,))

    def run(self, what: dict[str, Any], env: Mapping[str, str], cwd: Path | str | None = None,
            timeout: float = 600.0, input: str | None = None) -> subprocess.CompletedProcess[str]:
        """``what`` is ``{"module": name, "argv": [...]}`` (``python -m``) or ``{"script": source}`` (``-c``, with
        ``"sys_argv"`` its ``sys.argv``, ``["-c"]`` if none);
        ``input`` is the run's stdin (default: empty)."""
        with self._lock:
            self._count += 1
            parts = ("out", "err", "status", "in")
            out, err, status, given = (self._folder / f"{self._count}.{part}" for part in parts)
            request = {**what, "env": dict(env), "cwd": str(cwd or os.getcwd()), "stdout": str(out),
                       "stderr": str(err), "status": str(status)}
            if input is not None:
                given.write_text(input)
                request["stdin"] = str(given)
            pid = self._fork(request)
        child = ForkedChild(pid, status, ())
        try:
            code = child.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            raise subprocess.TimeoutExpired(str(what)[:200], timeout, out.read_text(), err.read_text()) from None
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


_shared: dict[str, ForkServer] = {}
_shared_lock = threading.Lock()


def shared(kind: str = "plain") -> ForkServer:
    """This test process's server of ``kind`` (``KINDS``), started on first use, closed at exit."""
    with _shared_lock:
        if kind not in _shared:
            _shared[kind] = server = ForkServer(kind)
            atexit.register(server.close)
        return _shared[kind]


def run_module(module: str, argv: list[str], env: Mapping[str, str], cwd: Path | str | None = None,
               timeout: float = 600.0, input: str | None = None,
               engine: bool = False) -> subprocess.CompletedProcess[str]:
    """``python -m module *argv`` with ``env`` in ``cwd``, as a child of this process's fork server; ``engine``:
    of the server that preloaded vLLM's engine (``ENGINE_PRELOADED``)."""
    return shared("engine" if engine else "plain").run({"module": module, "argv": argv}, env, cwd, timeout, input)


def run_script(script: str, env: Mapping[str, str], timeout: float = 600.0, cwd: Path | str | None = None,
               input: str | None = None) -> subprocess.CompletedProcess[str]:
    """``python -c script`` with ``env`` in ``cwd``, as a child of this process's fork server."""
    return shared().run({"script": script}, env, cwd, timeout, input)


if __name__ == "__main__":
    serve(sys.argv[1], sys.argv[2])
