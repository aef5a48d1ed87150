"""The README's serve recipe run verbatim (MODEL replaced by the tiny local model): its yaml saved as
``lmcache.yaml`` in the folder the block runs in, the block run by ``bash`` (a fresh ``vllm serve`` and all it
spawns, as a user starts it), driven by a real streaming client. The CPU tier the yaml configures serves a hit once
vLLM's own prefix cache has forgotten the prompts (reset through vLLM's dev route, as eviction would): exactly every
whole chunk, the same answers, and ``lmcache-platforms stats`` reads those hits and the hit rate from the server's
``/metrics``; the server stops cleanly on Ctrl-C (SIGINT to the group) and leaves no process behind."""

from __future__ import annotations

import json
import re
import shlex
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from lmcache_platforms.integration.vllm.stats import FAILURE_CAUSES
from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model
from lmcache_platforms.tools.demo.report import expected_hit_tokens
from lmcache_platforms.tools.demo.runners import Resources, base_env
from lmcache_platforms.tools.demo.server import VllmServer, vllm_command
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import TINY_WORKLOAD, build_workload
from tests.serving.processes import processes_mentioning

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 8000  # the README's command names no port: vLLM's default
POLICY = '{"kv_connector":"LMCachePlatformsConnector","kv_role":"kv_both","kv_load_failure_policy":"recompute"}'


def readme_serving_section() -> str:
    return (REPO / "README.md").read_text().split("\n## Serve it\n", 1)[1].split("\n## ", 1)[0]


def readme_serving_block() -> str:
    """The shell block of the README's "Serve it" section that runs ``vllm serve``."""
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", readme_serving_section(), re.S) if "vllm serve" in b]
    assert len(blocks) == 1, blocks
    return blocks[0]


def readme_lmcache_yaml() -> str:
    """The section's one yaml block: the LMCache configuration the block's ``LMCACHE_CONFIG_FILE`` names."""
    (block,) = re.findall(r"```yaml\n(.*?)```", readme_serving_section(), re.S)
    return block


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0


def block_command(block: str) -> tuple[dict[str, str], list[str]]:
    """The block as what it runs: the variables it exports and the one command line (``vllm`` named by the set-up
    venv's console script); anything else in it is refused, so nothing of the block is left out."""
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
    assert f"vllm serve MODEL --kv-transfer-config '{POLICY}'" in block
    assert "--no-disable-hybrid-kv-cache-manager" not in block
    env, command = block_command(block.replace("MODEL", "/models/m"))
    assert env == {"PYTHONHASHSEED": "0", "LMCACHE_CONFIG_FILE": "lmcache.yaml"}
    assert command == [vllm_command(), "serve", "/models/m", "--kv-transfer-config", POLICY]


def test_readme_yaml_is_one_servers_cpu_tier_as_lmcache_reads_it(tmp_path: Path) -> None:
    from lmcache.v1.config import LMCacheEngineConfig

    from lmcache_platforms.config import PlatformSettings

    path = tmp_path / "lmcache.yaml"
    path.write_text(readme_lmcache_yaml())
    config = LMCacheEngineConfig.from_file(str(path))
    assert (config.chunk_size, config.local_cpu, config.max_local_cpu_size) == (256, True, 5.0)
    assert (config.local_disk, config.remote_url) == (None, None)
    assert PlatformSettings.load(config.extra_config, env={}) == PlatformSettings()


def _forget_vllms_prefix_cache(base_url: str) -> None:
    """vLLM's own prefix cache emptied, the connector's store kept (no ``reset_external``): what eviction does."""
    request = urllib.request.Request(f"{base_url}/reset_prefix_cache", method="POST")
    with urllib.request.urlopen(request, timeout=30) as reply:
        assert reply.status == 200


def _stats_json(base_url: str) -> dict[str, Any]:
    """``lmcache-platforms stats URL --json`` run as a user runs it (this checkout's package), its last line."""
    result = subprocess.run([sys.executable, "-m", "lmcache_platforms.cli.main", "stats", base_url, "--json"],
                            cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_readme_recipe_hits_lmcaches_cpu_tier(tmp_path: Path) -> None:
    if not _port_free(DEFAULT_PORT):
        pytest.fail(f"port {DEFAULT_PORT} is taken: the README's command (vLLM's default port) cannot be tested")
    # Served through a link in this test's folder, so that only this test's processes name it (test workers
    # serve the same model at once).
    model = tmp_path / "model"
    model.symlink_to(ensure_model(TINY_MODEL))
    (tmp_path / "lmcache.yaml").write_text(readme_lmcache_yaml())
    chunk = yaml.safe_load(readme_lmcache_yaml())["chunk_size"]
    script = readme_serving_block().replace("MODEL", shlex.quote(str(model)))
    env = base_env(Resources.available())
    for key in ("VLLM_ENABLE_V1_MULTIPROCESSING", "PYTHONHASHSEED", "LMCACHE_CONFIG_FILE"):  # the block sets these
        env.pop(key, None)
    env.update({"VLLM_SERVER_DEV_MODE": "1",  # /reset_prefix_cache is a dev route
                "PATH": f"{Path(sys.executable).parent}:{env['PATH']}"})
    requests = build_workload(TINY_WORKLOAD, TINY_MODEL.vocab_size)
    prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in requests]
    server = VllmServer(["bash", "-c", f"cd {shlex.quote(str(tmp_path))} && {script}"], env,
                        tmp_path / "server.log", DEFAULT_PORT, start_timeout_s=400)
    with server:
        cold = run_requests(server.base_url, prompts, Sampling(max_tokens=8))
        _forget_vllms_prefix_cache(server.base_url)
        warm = run_requests(server.base_url, prompts, Sampling(max_tokens=8))
        stats = _stats_json(server.base_url)
    log = (tmp_path / "server.log").read_text()
    assert server.stopped_in_time and server.exit_code == 0, log[-3000:]
    assert not server.group_alive()
    assert processes_mentioning(str(model)) == [], "a server process outlived Ctrl-C"
    assert "does not support HMA" not in log and "kv cache group sizes (" in log
    assert [r["lmcache_hit_tokens"] for r in cold] == [0] * len(requests)
    assert [r["lmcache_hit_tokens"] for r in warm] == [expected_hit_tokens(len(r.tokens), chunk) for r in requests]
    assert all(hit >= chunk for hit in (r["lmcache_hit_tokens"] for r in warm))
    assert [r["tokens"] for r in warm] == [r["tokens"] for r in cold]
    assert all(len(r["tokens"]) == 8 for r in warm)
    # `lmcache-platforms stats` read the same server: LMCache's hits are the warm pass's whole chunks, over both
    # passes' prompt tokens; one store (cold) and one load (warm) per prompt, no failed load.
    hits = sum(expected_hit_tokens(len(r.tokens), chunk) for r in requests)
    prompt_tokens = 2 * sum(len(r.tokens) for r in requests)
    since_start = stats["since_start"]
    assert (since_start["hit_tokens"], since_start["prompt_tokens"]) == (hits, prompt_tokens), stats
    assert since_start["hit_rate"] == hits / prompt_tokens
    assert (since_start["loads"], since_start["stores"]) == (len(requests), len(requests)), stats
    assert since_start["bytes_loaded"] > 0 and since_start["bytes_stored"] > 0, stats
    assert since_start["loads_failed_by_cause"] == dict.fromkeys(sorted(FAILURE_CAUSES), 0), stats
