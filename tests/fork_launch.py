"""How the test session starts the tools' servers and engine passes (``lmcache_platforms.tools.demo.runners.launch``):
as children of this test process's fork servers (``tests/fork_server.py``). A fresh ``vllm serve`` spends ~11 s
of its start importing vLLM's CLI and OpenAI server, a fresh ``python -m`` pass ~8 s importing torch and vLLM's
engine (an engine pass tests no import order: it is forked from the server that preloaded vLLM's engine too),
~35 times a run; the child runs what the fresh process runs from its entry point on, in a session of its
own on the same cores, its command line showing the fresh process's command (strays are found by it). A server
child forks a zygote first, and what vLLM spawns (engine cores, workers: ~15 s of CPU importing vLLM each as fresh
interpreters) is forked from it in the server's process group instead (``tests/spawn_zygote.py``). Any other
command (the README's own shell command) starts fresh, and so does all it spawns."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from lmcache_platforms.tools.demo.runners import GroupLeader, Resources, start_fresh
from lmcache_platforms.tools.demo.server import vllm_command
from tests.fork_server import shared

# What the ``vllm`` console script runs.
CONSOLE_SCRIPT = "import sys\nfrom vllm.entrypoints.cli.main import main\nsys.exit(main())\n"


def start_forked(command: list[str], env: dict[str, str], log_path: Path,
                 resources: Resources | None) -> GroupLeader:
    cpus = resources.cores if resources else ()
    if command[0] == vllm_command():
        what, kind = {"script": CONSOLE_SCRIPT, "sys_argv": command, "zygote": True}, "serve"
    elif command[:2] == [sys.executable, "-m"]:
        what, kind = {"module": command[2], "argv": command[3:]}, "engine"
    else:
        return start_fresh(command, env, log_path, resources)
    return shared(kind).start(what, command, env, os.getcwd(), log_path, cpus)
