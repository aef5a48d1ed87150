"""vLLM's ``kv_load_failure_policy: fail`` through the real ``vllm serve`` (multiprocess engine) and an OpenAI
client: a load that fails ends that request with an error for its client, a request served beside it in the
same batch is untouched, the server goes on serving (the failed request, sent again, is computed), and its
``/metrics`` count the failed load once, under its cause.

The fault: every chunk file of the victim's prompt deleted from LMCache's local disk store after a cold pass,
while LMCache's index still lists them, so the lookup promises a hit and the load comes back empty.
"""

from __future__ import annotations

import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from lmcache_platforms.tools.demo.client import hit_counters, token_id
from lmcache_platforms.tools.demo.model import TINY_MODEL
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.scenario import BLOCK_SIZE, OUR_CONNECTOR
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.server_pass import serve_args
from tests.reliability.conftest import SHORT_LOAD
from tests.reliability.fault_run import MAX_TOKENS, prompt
from tests.serving.observe import scrape_by_label
from tests.serving.processes import processes_mentioning

pytestmark = pytest.mark.slow


def complete(client: Any, model: str, name: str) -> dict[str, Any]:
    """One greedy completion of a scenario prompt (sent as token ids): its tokens, or the error the client got."""
    from openai import APIError

    try:
        reply = client.completions.create(
            model=model, prompt=prompt(name), max_tokens=MAX_TOKENS, temperature=0.0, seed=0, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    except APIError as exc:
        return {"error": type(exc).__name__, "status": getattr(exc, "status_code", None)}
    choice = reply.choices[0]
    return {"tokens": [token_id(t) for t in choice.logprobs.tokens], "finish_reason": choice.finish_reason}


def wait_for_files(store: Path, count: int, timeout_s: float = 60.0) -> set[Path]:
    """LMCache writes disk chunks asynchronously: the store's files once there are ``count``."""
    deadline = time.monotonic() + timeout_s
    while len(files := set(store.iterdir())) < count:
        assert time.monotonic() < deadline, f"{len(files)} of {count} chunk files after {timeout_s} s"
        time.sleep(0.1)
    return files


def test_a_failed_load_ends_only_its_request_and_the_server_serves_on(model: Path, reference, tmp_path: Path):
    store = tmp_path / "store"
    store.mkdir()
    config = tmp_path / "lmcache.yaml"
    config.write_text(f'chunk_size: 64\nlocal_cpu: false\nmax_local_cpu_size: 0.5\nlocal_disk: "file://{store}/"\n'
                      "max_local_disk_size: 1\n")
    # Whole chunks: the scenario counts one disk file per chunk (parts would make two per chunk).
    kv_transfer_config = {"kv_connector": OUR_CONNECTOR, "kv_role": "kv_both", "kv_load_failure_policy": "fail",
                          "kv_connector_extra_config": {"platforms.chunk_parts": "whole"}}
    args = [*serve_args(BLOCK_SIZE, TINY_MODEL.max_model_len), "--no-enable-prefix-caching"]
    log = tmp_path / "server.log"
    server = VllmServer.for_model(model, kv_transfer_config, args, log, Resources.available(),
                                  {"LMCACHE_CONFIG_FILE": str(config)})
    from openai import OpenAI

    with server, OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300) as client:
        served = str(model)
        cold = {"victim": complete(client, served, "victim")}
        victim_files = wait_for_files(store, 4)
        cold["bystander"] = complete(client, served, "bystander")
        wait_for_files(store, 8)
        for path in victim_files:
            path.unlink()
        before = hit_counters(server.base_url)["lmcache"]
        with ThreadPoolExecutor(2) as pool:
            warm = dict(zip(("victim", "bystander"),
                            pool.map(lambda name: complete(client, served, name), ("victim", "bystander")),
                            strict=True))
        promised = hit_counters(server.base_url)["lmcache"] - before
        again = complete(client, served, "victim")
        failed = scrape_by_label(server.base_url, "loads_failed_total", "cause")
        with urllib.request.urlopen(f"{server.base_url}/health", timeout=5) as health:
            healthy = health.status
    for name in ("victim", "bystander"):
        assert cold[name] == {"tokens": reference[name], "finish_reason": "length"}, (name, cold[name])
    assert warm["bystander"] == {"tokens": reference["bystander"], "finish_reason": "length"}
    assert warm["victim"] == {"error": "InternalServerError", "status": 500}, warm["victim"]
    assert promised == 512  # both hits were promised; the victim's load came back empty
    assert again == {"tokens": reference["victim"], "finish_reason": "length"}
    assert healthy == 200
    assert failed == {"missing": 1, "corrupt": 0, "timeout": 0, "error": 0, "unregistered": 0}
    text = log.read_text(errors="replace")
    assert [m.groups() for m in SHORT_LOAD.finditer(text)] == [("0", "256", "0")]
    assert (server.exit_code, server.stopped_in_time) == (0, True)
    assert processes_mentioning(str(tmp_path)) == []
