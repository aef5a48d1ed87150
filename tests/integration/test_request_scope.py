"""A chunk is shared exactly where vLLM's prefix cache would share the block: requests under another LoRA
adapter or another ``cache_salt``, or after vLLM reset its prefix cache, never load each other's chunks (real
vLLM, a hand-written random adapter on k_proj/v_proj), each with a negative control."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from vllm.lora.request import LoRARequest

from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG, request_scope, scoped_configs
from tests.fork_server import run_module

REPO = Path(__file__).resolve().parents[2]
HIT = 256  # 300 prompt tokens: 4 whole chunks of 64 (the last token is always computed)


def test_scope_follows_vllms_block_hash_inputs():
    base = request_scope(None, None)
    assert request_scope(None, "") == base  # vLLM hashes a salt only when it is non-empty
    assert len({base, request_scope(None, "t1"), request_scope(None, "t2")}) == 3
    adapter = LoRARequest("a", 1, "/adapters/a")
    assert request_scope(LoRARequest("a", 7, "/adapters/a"), None) == request_scope(adapter, None)  # int id: no
    assert len({base, request_scope(adapter, None), request_scope(LoRARequest("a", 1, "/adapters/b"), None),
                request_scope(LoRARequest("b", 1, "/adapters/a"), None), request_scope(adapter, "t1")}) == 5
    assert request_scope(None, None, "") == base != request_scope(None, None, "g1") != request_scope(None, None, "g2")


def test_a_request_cannot_name_another_scope():
    class Request:
        lora_request = None
        cache_salt = "t2"

    forged = {SCOPE_TAG: request_scope(None, "t1"), "lmcache.tag.user": "x"}
    assert scoped_configs(Request(), forged) == {SCOPE_TAG: request_scope(None, "t2"), "lmcache.tag.user": "x"}


def write_adapter(folder: Path, num_layers: int, hidden: int, kv_width: int, rank: int = 8) -> Path:
    """A random PEFT LoRA adapter on every layer's k_proj and v_proj (B not zero, unlike PEFT's init)."""
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    weights = {}
    for layer in range(num_layers):
        for module in ("k_proj", "v_proj"):
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=generator) * 0.1
            weights[f"{name}.lora_B.weight"] = torch.randn(kv_width, rank, generator=generator) * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "bias": "none", "target_modules": ["k_proj", "v_proj"], "base_model_name_or_path": "tiny"}))
    return folder


def run(model: Path, options: dict) -> list[dict]:
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
    proc = run_module("tests.integration.scope_run", [str(model), json.dumps(options)], env, REPO, timeout=400,
                      engine=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def model() -> Path:
    from lmcache_platforms.tools.demo.model import TINY_MODEL, ensure_model

    return ensure_model(TINY_MODEL)


@pytest.fixture(scope="module")
def adapter(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lmcache_platforms.tools.demo.model import TINY_MODEL as spec

    return write_adapter(tmp_path_factory.mktemp("adapter"), spec.num_layers, spec.hidden_size,
                         spec.num_kv_heads * spec.head_dim)


@pytest.fixture(scope="module")
def reference(model: Path, adapter: Path) -> dict[str, list[int]]:
    """The answers of vLLM without any connector: base model and adapter (they differ)."""
    base, lora = run(model, {"connector": False, "adapter": str(adapter),
                             "requests": [{"lora": False}, {"lora": True}]})
    assert base["output"] != lora["output"]
    return {"base": base["output"], "lora": lora["output"]}


SALTED = [{"salt": "t1"}, {"salt": "t1"}, {"salt": "t2"}, {"salt": None}]


@pytest.mark.slow
def test_only_the_same_salt_hits(model, reference):
    results = run(model, {"requests": SALTED})
    assert [r["loaded_tokens"] for r in results] == [0, HIT, 0, 0]
    assert all(r["output"] == reference["base"] for r in results)


@pytest.mark.slow
def test_without_the_salt_in_the_key_other_tenants_hit(model, reference):
    results = run(model, {"requests": SALTED, "unscoped": "salt"})
    assert [r["loaded_tokens"] for r in results] == [0, HIT, HIT, HIT]


ADAPTED = [{"lora": False}, {"lora": True}, {"lora": True}]


@pytest.mark.slow
def test_an_adapter_never_loads_the_base_models_chunks(model, adapter, reference):
    results = run(model, {"adapter": str(adapter), "requests": ADAPTED})
    assert [r["loaded_tokens"] for r in results] == [0, 0, HIT]
    assert [r["output"] for r in results] == [reference["base"], reference["lora"], reference["lora"]]


@pytest.mark.slow
def test_without_the_adapter_in_the_key_it_loads_the_base_model_and_answers_wrongly(model, adapter, reference):
    results = run(model, {"adapter": str(adapter), "requests": ADAPTED, "unscoped": "lora"})
    assert [r["loaded_tokens"] for r in results] == [0, HIT, HIT]
    assert results[1]["output"] != reference["lora"]


@pytest.mark.slow
def test_after_vllm_resets_its_prefix_cache_nothing_stored_before_hits(model, reference):
    """``reset_connector``: the first request after the reset computes and stores anew, the next one hits;
    the control resets vLLM alone (our connector not asked) and keeps hitting the KV computed before."""
    requests = [{}, {}, {"reset": "connector"}, {}, {"reset": "vllm"}]
    results = run(model, {"requests": requests})
    assert [r["loaded_tokens"] for r in results] == [0, HIT, 0, HIT, HIT]
    assert all(r["output"] == reference["base"] for r in results)
