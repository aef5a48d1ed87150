"""LMCache's ``use_layerwise`` through real vLLM (CPU, in-process engines, ``tests/integration/layerwise_run.py``):
stores follow the forward layer by layer, a load in the step that computes its request runs ahead of the forward
layer by layer, and the chunk objects are the paged mode's, so what one mode stored the other loads. Each run
generates one 300-token prompt twice (the first pass computes or loads from the shared ``fs://`` store, the second
loads from the local CPU cache); tokens and top-5 logprobs must be identical across passes and runs, and a load
that writes zeros for one layer (the negative control) must change them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fork_server import run_module

REPO = Path(__file__).resolve().parents[2]
CHUNKS = 4  # 300 tokens: 4 whole chunks of 64

pytestmark = pytest.mark.slow


class Runs:
    """Each named run once per module, in the order the tests ask for them (later runs read earlier stores)."""

    def __init__(self, folder: Path) -> None:
        from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model

        self.model = ensure_model(TINY_MODEL)
        self.folder = folder
        self.done: dict[str, dict[str, Any]] = {}

    def get(self, name: str, **options: Any) -> dict[str, Any]:
        if name not in self.done:
            if "store" in options:
                store = self.folder / options["store"]
                store.mkdir(exist_ok=True)
                options["store"] = str(store)
            env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
            proc = run_module("tests.integration.layerwise_run", [str(self.model), json.dumps(options)], env, REPO,
                              timeout=400, engine=True)
            assert proc.returncode == 0, proc.stderr[-4000:]
            self.done[name] = json.loads(proc.stdout.strip().splitlines()[-1])
        return self.done[name]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Runs:
    return Runs(tmp_path_factory.mktemp("layerwise"))


def test_hybrid_model_stores_layer_by_layer_and_a_paged_engine_loads_it(runs: Runs) -> None:
    stored = runs.get("hybrid-layerwise", layerwise=True, store="hybrid")
    assert stored["groups"] == 4
    # One store call per chunk part (window parts beside the full-attention part), each moving every layer apart.
    assert (stored["chunks_stored"], stored["layers_stored"]) == (CHUNKS, sum(stored["layers_per_format"]))
    # Several groups: the warm pass loads while its request waits (no forward of its own to overlap), whole.
    assert (stored["chunks_loaded"], stored["layers_loaded"]) == (CHUNKS, 0)
    assert stored["passes"][0] == stored["passes"][1]

    paged = runs.get("hybrid-paged", layerwise=False, store="hybrid")
    assert (paged["chunks_stored"], paged["chunks_loaded"]) == (0, 2 * CHUNKS)  # from fs://, then the CPU cache
    assert (paged["layers_stored"], paged["layers_loaded"]) == (0, 0)
    assert paged["passes"] == stored["passes"]


def test_single_group_loads_in_step_layer_by_layer_what_a_paged_engine_stored(runs: Runs) -> None:
    paged = runs.get("single-paged", single_group=True, store="single")
    assert paged["groups"] == 1
    assert (paged["chunks_stored"], paged["chunks_loaded"]) == (CHUNKS, CHUNKS)
    assert (paged["layers_stored"], paged["layers_loaded"]) == (0, 0)
    assert paged["passes"][0] == paged["passes"][1]

    layerwise = runs.get("single-layerwise", layerwise=True, single_group=True, store="single")
    [layers] = layerwise["layers_per_format"]
    assert layers == 4
    assert (layerwise["chunks_stored"], layerwise["chunks_loaded"]) == (0, 2 * CHUNKS)
    # Both passes load in the step that computes the request: from fs://, then from the CPU cache.
    assert (layerwise["layers_stored"], layerwise["layers_loaded"]) == (0, 2 * layers)
    assert layerwise["passes"] == paged["passes"]


def test_a_layerwise_load_that_writes_one_layer_wrong_changes_the_answer(runs: Runs) -> None:
    """The negative control of the identity oracle above: the first layer's rows loaded as zeros."""
    planted = runs.get("single-layerwise-planted", layerwise=True, single_group=True, plant="zero_first_layer")
    assert (planted["chunks_loaded"], planted["layers_loaded"]) == (CHUNKS, 4)
    assert planted["passes"][0] != planted["passes"][1]
