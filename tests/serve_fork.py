"""``vllm serve`` for the test suite: each server the tools start (``lmcache_platforms.tools.demo.server.launch``)
is a child of this test process's ``serve`` fork server (``tests/fork_server.py``), which imported vLLM's CLI and
OpenAI server once. A fresh ``vllm serve`` spends ~11 s of its start importing those, ~30 times a run; from its
CLI entry point on, the child runs what the fresh process runs, in a session of its own on the same cores, and
vLLM spawns its engine core (and workers) as fresh interpreters either way. A command that is not the ``vllm``
script (the README's own shell command) still starts fresh."""

from __future__ import annotations

import os
from pathlib import Path

from lmcache_platforms.tools.demo.runners import GroupLeader, Resources
from lmcache_platforms.tools.demo.server import start_fresh, vllm_command
from tests.fork_server import shared

# What the ``vllm`` console script runs.
CONSOLE_SCRIPT = "import sys\nfrom vllm.entrypoints.cli.main import main\nsys.exit(main())\n"


def start_forked(command: list[str], env: dict[str, str], log_path: Path,
                 resources: Resources | None) -> GroupLeader:
    if command[0] != vllm_command():
        return start_fresh(command, env, log_path, resources)
    return shared("serve").start({"script": CONSOLE_SCRIPT, "sys_argv": command}, env, os.getcwd(), log_path,
                                 resources.cores if resources else ())
