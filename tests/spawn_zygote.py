"""A zygote for what a forked ``vllm serve`` (``tests/fork_server.py``) spawns: its engine cores and workers.

vLLM's CPU platform starts them with multiprocessing's ``spawn`` method: a fresh interpreter that spends ~15 s of
CPU importing torch, transformers and vLLM before it unpickles its target, once per engine core and per worker of
each of the suite's servers. A server child forks this zygote before it runs anything, so the zygote is in the
server's session and process group (Ctrl-C and the harness's group kill reach it and all it starts) and holds
nothing of LMCache or of our package; it imports what a spawned engine core or worker imports first (vLLM's
engine and worker modules, ~1 s on top of what the server preloaded) and checks that LMCache did not come with
them. The server's multiprocessing (and, through the environment, its spawned processes' own) then launches each
spawn through the zygote: the descriptors a spawn passes (its two pipes, the resource tracker's, and the standard
streams) cross a Unix socket and land at the same numbers in a forked child, which takes the spawning process's
environment, folder, cores and the spawn's command line, closes everything else, and runs multiprocessing's own
``spawn_main``: it reads its preparation data and target from the pipe, as the fresh interpreter would.

The spawned process is the zygote's child, not the spawner's: the spawner learns its end from a status file the
child writes as it leaves (or the zygote, for a killed child), where ``waitpid`` would have told it.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import gc
import importlib
import io
import itertools
import json
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from multiprocessing import popen_spawn_posix, reduction, resource_tracker, spawn, util
from multiprocessing.context import set_spawning_popen
from pathlib import Path
from typing import Any

SOCKET_ENV = "LMCP_TEST_SPAWN_ZYGOTE"
PRELOADED = ("vllm.v1.engine.core", "vllm.v1.executor.multiproc_executor", "vllm.v1.worker.cpu_worker")
UNTOUCHED = ("lmcache",)
_PR_SET_PDEATHSIG = 1
_MESSAGE_BYTES = 1 << 20
_MAX_FDS = 64
_counter = itertools.count()


def start(folder: Path, leave: Callable[[int, str], None], reap: Callable[[dict[int, str]], None],
          adopt_environment: Callable[[dict[str, str]], None]) -> None:
    """In a server child before it runs: fork the zygote (listening in ``folder``) and send this process's spawns,
    and those of the processes it spawns, through it. ``leave``, ``reap`` and ``adopt_environment`` are the fork
    server's: how a child ends, how ended children are reaped, how a child takes its environment."""
    path = folder / f"{os.getpid()}.zygote"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(str(path))
    listener.listen(16)
    os.environ[SOCKET_ENV] = str(path)
    popen_spawn_posix.Popen = ZygotePopen  # type: ignore[misc]  # what SpawnProcess starts its children with
    server = os.getpid()
    if os.fork() == 0:
        _serve(listener, server, leave, reap, adopt_environment)
    listener.close()


def _serve(listener: socket.socket, server: int, leave: Callable[[int, str], None],
           reap: Callable[[dict[int, str]], None], adopt_environment: Callable[[dict[str, str]], None]) -> None:
    """The zygote: gone with its server; Ctrl-C to the group is the server's to handle, not the zygote's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != server:
        os._exit(0)
    for name in PRELOADED:
        importlib.import_module(name)
    if loaded := sorted(name for name in sys.modules if name.startswith(UNTOUCHED)):
        print(f"spawn zygote: the preloaded modules imported what a spawned process must import: {loaded}",
              file=sys.stderr, flush=True)
        os._exit(1)
    gc.freeze()  # as the fork server does: the spawned processes' collections skip what the zygote holds
    children: dict[int, str] = {}
    signal.signal(signal.SIGCHLD, lambda *_: reap(children))
    while True:
        connection, _ = listener.accept()
        with connection:
            message, fds, _, _ = socket.recv_fds(connection, _MESSAGE_BYTES, _MAX_FDS)
            request = json.loads(message)
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})  # reaped only once it is known
            pid = os.fork()
            if pid == 0:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
                listener.close()
                connection.close()
                _spawned(request, fds, leave, adopt_environment)
            children[pid] = request["status"]
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode())


def _spawned(request: dict[str, Any], fds: list[int], leave: Callable[[int, str], None],
             adopt_environment: Callable[[dict[str, str]], None]) -> None:
    """In the zygote's child: stand where the fresh interpreter would, then run ``spawn_main``."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    targets = request["fds"]
    floor = max([*targets, *fds]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for fd, target in zip(moved, targets, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    for entry in os.listdir("/proc/self/fd"):  # what spawn's close_fds leaves: only the passed descriptors
        if int(entry) not in targets:
            with contextlib.suppress(OSError):  # the listing's own descriptor, already closed
                os.close(int(entry))
    adopt_environment(request["env"])
    os.chdir(request["cwd"])
    os.sched_setaffinity(0, request["cpus"])
    import setproctitle

    setproctitle.setproctitle(request["title"])
    sys.argv = request["argv"]
    code = 1
    try:
        spawn.spawn_main(tracker_fd=request["tracker_fd"], pipe_handle=request["pipe_handle"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    leave(code, request["status"])


class ZygotePopen(popen_spawn_posix.Popen):
    """multiprocessing's spawn launcher, with the zygote's forked child in place of a fresh interpreter."""

    _status: Path

    def _launch(self, process_obj: Any) -> None:
        tracker_fd = resource_tracker.getfd()
        self._fds.append(tracker_fd)
        data = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(spawn.get_preparation_data(process_obj._name), data)
            reduction.dump(process_obj, data)
        finally:
            set_spawning_popen(None)
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        try:
            self._fds.extend([child_r, child_w])
            command = spawn.get_command_line(tracker_fd=tracker_fd, pipe_handle=child_r)
            self.pid, self._status = _ask_zygote(self._fds, tracker_fd, child_r, command)
            self.sentinel = parent_r
            with open(parent_w, "wb", closefd=False) as pipe:
                pipe.write(data.getbuffer())
        finally:
            self.finalizer = util.Finalize(self, util.close_fds, (parent_r, parent_w))
            os.close(child_r)
            os.close(child_w)

    def poll(self, flag: int = os.WNOHANG) -> int | None:
        """The child's exit status once it is gone (reaped by the zygote): its status file, else -1 if it left none;
        ``flag`` 0 waits."""
        while self.returncode is None:
            if not alive(self.pid):
                self.returncode = int(self._status.read_text()) if self._status.exists() else -1
                self._status.unlink(missing_ok=True)
            elif flag == os.WNOHANG:
                return None
            else:
                time.sleep(0.02)
        return self.returncode


def _ask_zygote(fds: list[int], tracker_fd: int, pipe_handle: int, command: list[str | bytes]) -> tuple[int, Path]:
    """Have the zygote start the spawn; its pid and status file."""
    passed = list(dict.fromkeys([0, 1, 2, *fds]))
    words = [os.fsdecode(word) for word in command]
    argv = ["-c", *words[words.index("-c") + 2:]]  # what sys.argv is in ``python ... -c CODE ARGS``
    path = os.environ[SOCKET_ENV]
    status = Path(f"{path}.{os.getpid()}.{next(_counter)}.status")
    request = {"fds": passed, "env": dict(os.environ), "cwd": os.getcwd(), "cpus": sorted(os.sched_getaffinity(0)),
               "title": " ".join(words), "argv": argv, "tracker_fd": tracker_fd, "pipe_handle": pipe_handle,
               "status": str(status)}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as zygote:
        zygote.connect(path)
        socket.send_fds(zygote, [json.dumps(request).encode()], passed)
        return json.loads(zygote.recv(_MESSAGE_BYTES))["pid"], status


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one that ended still does until it is reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
