"""The fork server's children end as a fresh interpreter does: the same output, in the same order, and the same
exit status, with a thread outliving the main module (joined), exit handlers (run after it), a daemon thread
(abandoned), ``sys.exit`` and an uncaught exception. A started child (how the tests start servers and engine
passes: ``tests/fork_launch.py``) stands where ``subprocess.Popen`` with a session of its own would: its own
process group, the given cores, its output in one log, the fresh command on its command line, and the exit status
``Popen`` reports, a killing signal's included."""

from __future__ import annotations

import ast
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


PROBE_TARGET = '''
import os, sys


def report(conn, parent_group, code):
    print("spawned child ran", flush=True)
    conn.send({"argv": sys.argv, "cwd": os.getcwd(), "late": os.environ.get("PROBE_LATE"),
               "same_group": os.getpgid(0) == parent_group, "cpus": sorted(os.sched_getaffinity(0)),
               "marker": "probe_marker" in sys.modules, "lmcache": any(m.startswith("lmcache") for m in sys.modules),
               "standard_streams": [os.path.sameopenfile(fd, 1) for fd in (1, 2)]})
    conn.close()
    sys.exit(code)


def wait_forever():
    import time
    time.sleep(600)
'''
SPAWNER = '''
import multiprocessing as mp, os, signal, sys
import probe_marker, probe_target
mp.set_start_method(sys.argv[1])
os.environ["PROBE_LATE"] = "set after start"
reader, writer = mp.Pipe(duplex=False)
child = mp.Process(target=probe_target.report, args=(writer, os.getpgid(0), 7))
child.start()
writer.close()
print(sorted(reader.recv().items()), flush=True)
child.join()
hung = mp.Process(target=probe_target.wait_forever)
hung.start()
hung.kill()
hung.join()
print(child.exitcode, hung.exitcode, flush=True)
'''


def _spawn_probe(folder: Path) -> tuple[str, dict[str, str]]:
    """The spawner script and its environment: the target in an importable module, a marker module the spawner
    imports (a spawned process must not have it)."""
    (folder / "probe_target.py").write_text(PROBE_TARGET)
    (folder / "probe_marker.py").write_text("")
    return SPAWNER, clean_environment(PYTHONPATH=str(folder))


@pytest.mark.parametrize("method", ["spawn", "fork"], ids=["spawn", "negative-control-fork"])
def test_what_a_server_child_spawns_stands_where_a_fresh_spawn_would(tmp_path: Path, method: str) -> None:
    """A server child (``zygote``: how ``vllm serve`` is started, ``tests/fork_launch.py``) spawns through its zygote
    (``tests/spawn_zygote.py``): the spawned process gets its pipe, the spawner's environment at start, folder,
    cores, standard streams, process group and the spawn's ``sys.argv``, none of the spawner's modules, and its exit
    status (a killing signal's included) reaches the spawner, as from a fresh interpreter's spawn of the same script.
    Negative control: forked instead of spawned, the child has the spawner's modules, and the comparison sees it."""
    script, env = _spawn_probe(tmp_path)
    log = tmp_path / "child.log"
    cpu = min(os.sched_getaffinity(0))
    command = [sys.executable, "-c", "spawner", str(tmp_path)]
    child = shared("serve").start({"script": script, "sys_argv": ["-c", method], "zygote": True}, command, env,
                                  tmp_path, log, (cpu,))
    assert child.wait(timeout=120) == 0, log.read_text()[-3000:]
    fresh_log = tmp_path / "fresh.log"
    with fresh_log.open("w") as out:
        subprocess.run(["taskset", "-c", str(cpu), sys.executable, "-c", script, method], stdout=out,
                       stderr=subprocess.STDOUT, env=env, cwd=tmp_path, timeout=120, check=True)
    lines = fresh_log.read_text().splitlines()
    assert log.read_text().splitlines() == lines
    report = dict(ast.literal_eval(lines[1]))
    assert report["marker"] == (method == "fork")
    assert lines[::2] == ["spawned child ran", "7 -9"]
    if method == "spawn":
        assert report == {"argv": ["-c", "spawn"], "cwd": str(tmp_path), "late": "set after start",
                          "same_group": True, "cpus": [cpu], "marker": False, "lmcache": False,
                          "standard_streams": [True, True]}


def test_the_zygote_serves_spawns_of_spawned_processes_and_dies_with_its_server(tmp_path: Path) -> None:
    """A spawned process spawns in turn (an engine core its workers) through the same zygote; once the server child
    is killed, its zygote and everything spawned are gone too (the group's kill reaches them all)."""
    (tmp_path / "nested.py").write_text(
        "import multiprocessing as mp, os, time\n"
        "def grandchild():\n    print('grandchild', os.getpgid(0) == int(os.environ['GROUP']), flush=True)\n"
        "def child():\n    mp.set_start_method('spawn', force=True)\n    g = mp.Process(target=grandchild)\n"
        "    g.start(); g.join(); print('grandchild ended', g.exitcode, flush=True); time.sleep(600)\n")
    script = ("import multiprocessing as mp, os, time\nimport nested\nos.environ['GROUP'] = str(os.getpgid(0))\n"
              "mp.set_start_method('spawn')\nc = mp.Process(target=nested.child)\nc.start()\ntime.sleep(600)\n")
    log = tmp_path / "child.log"
    child = shared("serve").start({"script": script, "zygote": True}, [sys.executable, "-c", str(tmp_path)],
                                  clean_environment(PYTHONPATH=str(tmp_path)), tmp_path, log)
    deadline = time.monotonic() + 120
    # The child's print reaches the log in pieces (its stream writes through): wait for the whole last line.
    while not _ended_line(log, "grandchild ended") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert log.read_text() == "grandchild True\ngrandchild ended 0\n"
    members = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _group_of(pid) == child.pid]
    # The server child, its zygote, multiprocessing's resource tracker, the spawned child (sleeping).
    assert len(members) == 4, members
    os.killpg(child.pid, signal.SIGKILL)
    assert child.wait(timeout=60) == -signal.SIGKILL
    deadline = time.monotonic() + 30
    while any(_group_of(pid) == child.pid for pid in members) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [pid for pid in members if _group_of(pid) == child.pid] == []


def _ended_line(log: Path, start: str) -> bool:
    """Whether ``log`` holds a whole line beginning with ``start``."""
    text = log.read_text() if log.exists() else ""
    return any(line.startswith(start) for line in text.splitlines(keepends=True) if line.endswith("\n"))


def _group_of(pid: int) -> int | None:
    """The process group of a living process (not one that ended and waits to be reaped), else None."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return None
    return None if fields[0] in ("Z", "X") else int(fields[2])


RANKS = """
import torch
from vllm.v1.sample.ops.logprobs import batched_count_greater_than
torch.set_num_threads(2)
logprobs = torch.tensor([[-1.0, -3.0, -0.5, -2.0, -0.1], [-4.0, -0.2, -0.3, -9.0, -1.0], [0.0, -1.0, -2.0, -3.0, -4.0]])
ranked = torch.tensor([[-2.0], [-0.3], [0.0]])
torch._dynamo.decorators.mark_unbacked(logprobs, 0)
torch._dynamo.decorators.mark_unbacked(ranked, 0)
print(batched_count_greater_than(logprobs, ranked).tolist(), flush=True)
"""
# In a server child: a forked grandchild runs RANKS (the child waits for it at most 15 s); the child then warms
# the op on two threads as the servers do on one (tests/warm_sampler.py), and a second grandchild runs RANKS.
WARMED_FORKS = """
import os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import warm_sampler

def ranks_in_a_forked_child():
    pid = os.fork()
    if pid == 0:
        exec(compile(RANKS, "<ranks>", "exec"))
        os._exit(0)
    deadline = time.monotonic() + 15
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            print("the child hung", flush=True)
            return
        time.sleep(0.1)

ranks_in_a_forked_child()
warm_sampler.warm(2)
ranks_in_a_forked_child()
"""


def test_a_child_ranks_sampled_tokens_with_vllms_compiled_op_on_two_threads() -> None:
    """The op the servers compiled before they forked (tests/warm_sampler.py) runs in a child on two threads and
    counts, per row, the logprobs at or above the sampled token's (its rank)."""
    forked = run_script(RANKS, clean_environment(), timeout=120)
    assert (forked.returncode, forked.stdout) == (0, "[4, 2, 1]\n"), forked.stderr[-3000:]


def test_negative_control_a_warm_up_on_two_threads_hangs_the_child() -> None:
    """Forked from a server, which warmed the op on one thread, a child answers; once its parent warmed it on two
    (an OpenMP parallel region run), the child's own hangs."""
    forked = run_script(f"RANKS = {RANKS!r}\n" + WARMED_FORKS, clean_environment(), timeout=120,
                        cwd=Path(__file__).resolve().parents[1])
    assert (forked.returncode, forked.stdout) == (0, "[4, 2, 1]\nthe child hung\n"), forked.stderr[-3000:]
