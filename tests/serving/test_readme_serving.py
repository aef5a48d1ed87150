"""The README's serving command (MODEL replaced by the tiny local model), driven by a real streaming client: a cold
server, the block run verbatim by ``bash`` (a fresh ``vllm serve`` and all it spawns, as a user starts it),
stores; a fresh server of the same command loads exactly every whole chunk and answers identically; both stop
cleanly on Ctrl-C (SIGINT to the group) and leave no process behind.

The fresh server is started as the other serving tests start theirs (``tests/fork_launch.py``: forked from an
interpreter that imported vLLM's CLI; what it spawns forked from a zygote): the cold one already shows that a
fresh interpreter activates the package from its entry point, and its three fresh interpreters (API server,
engine core, worker) spend about 35 s importing vLLM before anything this test is about."""

from __future__ import annotations

import re
import shlex
import socket
import sys
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.report import expected_hit_tokens
from lmcache_platforms.tools.demo.runners import Resources, base_env
from lmcache_platforms.tools.demo.scenario import lmcache_yaml
from lmcache_platforms.tools.demo.server import VllmServer, vllm_command
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import TINY_WORKLOAD, build_workload
from tests.serving.processes import processes_mentioning

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 8000  # the README's command names no port: vLLM's default
CHUNK = 64


def readme_serving_block() -> str:
    """The shell block of the README's "Using it with vLLM" section that runs ``vllm serve``."""
    section = (REPO / "README.md").read_text().split("## Using it with vLLM", 1)[1].split("\n## ", 1)[0]
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "vllm serve" in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def block_command(block: str) -> tuple[dict[str, str], list[str]]:
    """The block as what it runs: the variables it exports and the one command line (``vllm`` named by the set-up
    venv's console script); anything else in it is refused, so nothing of the block is left out. (A forked server
    keeps its fork server's hash seed, 0: the documented command's test pins the block's to the same.)"""
    env, commands = {}, []
    for words in filter(None, (shlex.split(line) for line in block.splitlines())):
        if words[0] == "export":
            for word in words[1:]:
                name, value = word.split("=", 1)  # a bare ``export NAME`` is refused here
                env[name] = value
        else:
            commands.append(words)
    assert [command[:2] for command in commands] == [["vllm", "serve"]], block
    return env, [vllm_command(), *commands[0][1:]]


def test_readme_block_is_the_documented_command() -> None:
    block = readme_serving_block()
    assert "vllm serve MODEL --kv-transfer-config " in block
    assert '\'{"kv_connector":"LMCachePlatformsConnector","kv_role":"kv_both"}\'' in block
    assert "--no-disable-hybrid-kv-cache-manager" not in block
    env, command = block_command(block.replace("MODEL", "/models/m"))
    assert env == {"PYTHONHASHSEED": "0"}
    assert command == [vllm_command(), "serve", "/models/m", "--kv-transfer-config",
                       '{"kv_connector":"LMCachePlatformsConnector","kv_role":"kv_both"}']


def test_readme_serving_command_hits_lmcache_in_a_fresh_server(tmp_path: Path) -> None:
    if not _port_free(DEFAULT_PORT):
        pytest.fail(f"port {DEFAULT_PORT} is taken: the README's command (vLLM's default port) cannot be tested")
    # Served through a link in this test's folder, so that only this test's processes name it (test workers
    # serve the same model at once).
    model = tmp_path / "model"
    model.symlink_to(ensure_model(TINY_MODEL))
    script = readme_serving_block().replace("MODEL", shlex.quote(str(model)))
    exported, command = block_command(script)
    config = tmp_path / "lmcache.yaml"
    config.write_text(lmcache_yaml(CHUNK, tmp_path / "store", cpu_gib=0.5))
    env = base_env(Resources.available())
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONHASHSEED"):  # the user's defaults; the block sets the seed
        env.pop(key)
    # vLLM 0.32's CPU build cannot load its own ahead-of-time compile artifacts ("'function' object has no
    # attribute 'finalize_loading'", with or without this package) and compiles the model again at every start;
    # its older compile cache loads, so the warm server reuses the cold one's graph (about 30 s fewer here).
    env["VLLM_USE_AOT_COMPILE"] = "0"
    env.update({"LMCACHE_CONFIG_FILE": str(config), "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"})
    requests = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)
    prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in requests]
    results = {}
    for phase, argv, phase_env in (("cold", ["bash", "-c", script], env), ("warm", command, env | exported)):
        server = VllmServer(argv, phase_env, tmp_path / f"{phase}.log", DEFAULT_PORT, start_timeout_s=400)
        with server:
            results[phase] = run_requests(server.base_url, prompts, Sampling(max_tokens=8))
        assert server.stopped_in_time and server.exit_code == 0, (tmp_path / f"{phase}.log").read_text()[-3000:]
        assert not server.group_alive()
    assert processes_mentioning(str(model)) == [], "a server process outlived Ctrl-C"
    log = (tmp_path / "warm.log").read_text()
    assert "does not support HMA" not in log and "kv cache group sizes (" in log
    warm, cold = results["warm"], results["cold"]
    assert [r["lmcache_hit_tokens"] for r in warm] == [expected_hit_tokens(len(r.tokens), CHUNK) for r in requests]
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in cold]
    assert all(len(r["tokens"]) == 8 for r in warm)
