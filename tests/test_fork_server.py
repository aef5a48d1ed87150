"""The fork server's children end as a fresh interpreter does: the same output, in the same order, and the same
exit status, with a thread outliving the main module (joined), exit handlers (run after it), a daemon thread
(abandoned), ``sys.exit`` and an uncaught exception. A started child (how the tests start servers and engine
passes: ``tests/fork_launch.py``) stands where ``subprocess.Popen`` with a session of its own would: its own
process group, the given cores, its output in one log, the fresh command on its command line, and the exit status
``Popen`` reports, a killing signal's included."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.fork_server import clean_environment, run_script, shared
from tests.serving.processes import processes_mentioning

ENDINGS = {
    "exit-3": "sys.exit(3)",
    "exception": "raise RuntimeError('planted')",
    "falls-off": "pass",
}
BODY = """
import atexit, sys, threading, time
def late():
    time.sleep(0.3)
    print("thread joined", flush=True)
def daemon():
    time.sleep(30)
    print("daemon outlived the run", flush=True)
threading.Thread(target=late).start()
threading.Thread(target=daemon, daemon=True).start()
atexit.register(lambda: print("atexit ran", flush=True))
print("main done", flush=True)
"""


@pytest.mark.parametrize("ending", sorted(ENDINGS))
def test_a_child_ends_as_a_fresh_interpreter_does(ending: str) -> None:
    script = BODY + ENDINGS[ending] + "\n"
    env = clean_environment()
    forked = run_script(script, env, timeout=60)
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)
    assert (forked.stdout, forked.returncode) == (fresh.stdout, fresh.returncode)
    assert forked.stdout == "main done\nthread joined\natexit ran\n"
    assert forked.returncode == {"exit-3": 3, "exception": 1, "falls-off": 0}[ending]
    assert ("RuntimeError: planted" in forked.stderr) == (ending == "exception")


def test_negative_control_a_run_leaving_before_its_exit_handlers_prints_less() -> None:
    """A run that leaves by ``os._exit`` skips its thread's end and its exit handlers, in a fresh interpreter as in a
    child: the output compared above tells that apart. The child wrote no status: the server says -1."""
    script = "import os\n" + BODY + "sys.stdout.flush(); os._exit(0)\n"
    forked = run_script(script, clean_environment(), timeout=60)
    fresh = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=clean_environment(),
                           timeout=60)
    assert forked.stdout == fresh.stdout == "main done\n"
    assert (forked.returncode, fresh.returncode) == (-1, 0)


def test_a_started_child_stands_where_a_fresh_process_in_its_own_session_would(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    command = [sys.executable, "-c", "stands-for", str(tmp_path)]
    script = ("import os, sys, time\nprint(os.getpgid(0) == os.getpid(), sorted(os.sched_getaffinity(0)))\n"
              "print('to stderr', file=sys.stderr, flush=True)\nsys.exit(int(sys.argv[1]))\n")
    cpu = min(os.sched_getaffinity(0))
    child = shared().start({"script": script, "sys_argv": ["-c", "7"]}, command, clean_environment(), tmp_path, log,
                           (cpu,))
    assert child.wait(timeout=60) == 7
    assert log.read_text() == f"True [{cpu}]\nto stderr\n"
    hung = shared().start({"script": "import time\ntime.sleep(600)\n"}, command, clean_environment(), tmp_path, log)
    deadline = time.monotonic() + 30
    while processes_mentioning(str(tmp_path)) != [hung.pid] and time.monotonic() < deadline:
        time.sleep(0.05)  # the child names itself just after the fork
    assert processes_mentioning(str(tmp_path)) == [hung.pid]
    assert hung.poll() is None
    os.killpg(hung.pid, signal.SIGKILL)
    assert hung.wait(timeout=60) == -signal.SIGKILL
    assert processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize("multiprocess", [True, False], ids=["dir-set", "no-dir"])
def test_a_child_counts_metrics_as_a_fresh_interpreter_in_its_environment_would(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multiprocess: bool) -> None:
    """prometheus_client (which the engine preload imports) picks its value class from
    ``PROMETHEUS_MULTIPROC_DIR`` at import. LMCache sets that variable in a test worker that built an engine, so
    a fork server started later preloaded the multiprocess class, and a server child without the variable
    failed at its first metric (``TypeError: expected str, bytes or os.PathLike object, not NoneType``). The
    servers leave it out, and a child picks the class its own environment gives."""
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    assert "PROMETHEUS_MULTIPROC_DIR" not in clean_environment()
    env = clean_environment(**({"PROMETHEUS_MULTIPROC_DIR": str(tmp_path)} if multiprocess else {}))
    script = ("import prometheus_client\nprometheus_client.Counter('probe', 'probe').inc()\n"
              "print(prometheus_client.values.ValueClass.__name__)\n")
    child = shared("engine").run({"script": script}, env, timeout=120)
    assert (child.returncode, child.stdout) == (0, "MmapedValue\n" if multiprocess else "MutexValue\n"), \
        child.stderr[-2000:]
