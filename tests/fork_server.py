"""A fork server for scripts that must each start with a fresh import state of vLLM and LMCache.

A fresh interpreter that imports vLLM's connector factory and LMCache's adapter costs ~9 s, three quarters of it
in torch, transformers and vLLM's config modules, which no import-order case is about. This server imports those
once, checks that nothing of LMCache, of ours or of vLLM's KV-transfer package came with them, then forks one
child per script: each child starts from exactly that state, as a fresh interpreter would after those imports.

Run as ``python -c <this file's source>`` (so that ``sys.path`` starts with the working folder, as for
``python -c <script>``); one JSON request a line on stdin, one JSON answer a line on stdout.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

PRELOADED = ("torch", "transformers", "vllm.config", "vllm.engine.arg_utils")
# What the cases import in their own order: none of it may be loaded before a case starts.
UNTOUCHED = ("lmcache", "vllm.distributed.kv_transfer")


def _run_child(request: dict[str, Any]) -> None:
    """In the forked child: the script with its own environment and output files; never returns."""
    code = 1
    try:
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        os.environ.clear()
        os.environ.update(request["env"])
        exec(compile(request["script"], "<script>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except Exception:  # noqa: BLE001 - any failure is the script's: on its stderr, a non-zero status
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve() -> None:
    for name in PRELOADED:
        importlib.import_module(name)
    loaded = sorted(name for name in sys.modules if name.startswith(UNTOUCHED))
    print(json.dumps({"loaded": loaded}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


class ForkServer:
    """The client: ``run`` gives what ``subprocess.run([python, "-c", script])`` would, from a forked child."""

    def __init__(self, env: dict[str, str]) -> None:
        self._folder = Path(tempfile.mkdtemp(prefix="fork-server-"))
        with open(self._folder / "server.err", "w") as errors:
            self._process = subprocess.Popen([sys.executable, "-c", Path(__file__).read_text()], env=env, text=True,
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors)
        ready = self._answer()
        assert ready["loaded"] == [], f"the preloaded modules imported what the scripts must import: {ready}"
        self._count = 0

    def _answer(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        assert line, f"the fork server died: {(self._folder / 'server.err').read_text()[-3000:]}"
        return json.loads(line)

    def run(self, script: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
        assert self._process.stdin is not None
        self._count += 1
        out, err = (self._folder / f"{self._count}.{name}" for name in ("out", "err"))
        request = {"script": script, "env": env, "stdout": str(out), "stderr": str(err)}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        returncode = self._answer()["returncode"]
        return subprocess.CompletedProcess([], returncode, out.read_text(), err.read_text())

    def close(self) -> None:
        assert self._process.stdin is not None
        self._process.stdin.close()
        self._process.wait(timeout=60)
        assert self._process.stdout is not None
        self._process.stdout.close()
        for path in self._folder.iterdir():
            path.unlink()
        self._folder.rmdir()


if __name__ == "__main__":
    serve()
