"""vLLM's ``LMCacheConnectorV1`` in an in-process ``LLM`` with this package installed: a dense model and a
Gemma-3-like hybrid (vLLM turns its hybrid KV-cache manager off for this connector) store every whole chunk
and load them on the repeat, answering exactly as vLLM without a connector (tokens and top-5 logprobs). The
negative control overwrites the stored chunks between the passes: the same oracle then sees the answer change.

LMCache's ``LMCacheConnectorV1Dynamic`` is served in ``tests/serving/test_upstream_names.py``: in one process,
vLLM imports its module while validating the config, before the CPU worker starts, and that worker then fails
(``'_lib_fn_wrapper' object has no attribute 'get'``) with or without this package (REFERENCE: importing
LMCache that early crashes vLLM's CPU worker)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.model import TINY_DENSE_MODEL, TINY_MODEL, ModelSpec, ensure_model
from tests.fork_server import run_module

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _run(model: ModelSpec, connector: str, *flags: str, **extra_env: str) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO), **extra_env}
    proc = run_module("tests.integration.upstream_names_run", [str(ensure_model(model)), connector, *flags], env,
                      REPO, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def without_connector() -> dict:
    return _run(TINY_DENSE_MODEL, "none")


@pytest.mark.parametrize("model", [TINY_DENSE_MODEL, TINY_MODEL], ids=["dense", "gemma3-hma-off"])
def test_lmcache_connector_v1_loads_every_chunk_and_answers_as_without_it(model: ModelSpec,
                                                                           without_connector: dict) -> None:
    result = _run(model, "LMCacheConnectorV1")
    assert (result["hma"], result["groups"], result["wrapper"]) == (False, 1, "LMCacheConnectorV1")
    assert (result["chunks_stored"], result["chunks_loaded"]) == (4, 4)  # 300 tokens: 4 whole chunks of 64
    cold, warm = result["passes"]
    assert warm == cold
    if model is TINY_DENSE_MODEL:
        assert cold == without_connector["passes"][0]


def test_the_identical_answer_oracle_catches_corrupt_chunks() -> None:
    result = _run(TINY_DENSE_MODEL, "LMCacheConnectorV1", "--corrupt")
    assert result["corrupted"] == 4 and result["chunks_loaded"] == 4
    cold, warm = result["passes"]
    assert warm["logprobs"] != cold["logprobs"]


def test_a_vllm_without_lmcache_is_unchanged_by_the_plugin(without_connector: dict) -> None:
    """No connector and vLLM's ExampleConnector, with our plugin loaded and without it (``VLLM_PLUGINS`` naming
    none of ours): the same answers, and the plugin imports no LMCache."""
    unplugged = _run(TINY_DENSE_MODEL, "none", VLLM_PLUGINS="none")
    example = _run(TINY_DENSE_MODEL, "ExampleConnector")
    example_unplugged = _run(TINY_DENSE_MODEL, "ExampleConnector", VLLM_PLUGINS="none")
    assert without_connector["lmcache_imported"] is False and example["lmcache_imported"] is False
    for result in (unplugged, example, example_unplugged):
        assert result["passes"] == without_connector["passes"]


def test_the_kept_upstream_adapter_still_serves_our_connector() -> None:
    """The way out (LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER=1) leaves upstream's impl under its name; our
    connector builds ours directly and still loads every chunk."""
    result = _run(TINY_MODEL, "LMCachePlatformsConnector", LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER="1")
    assert (result["hma"], result["wrapper"], result["chunks_stored"], result["chunks_loaded"]) == (
        True, "LMCachePlatformsConnector", 4, 4)
    cold, warm = result["passes"]
    assert warm == cold
