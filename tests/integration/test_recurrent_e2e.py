"""A GDN hybrid (tiny random Qwen3-Next: 3 recurrent layers + 1 full-attention layer) in real vLLM CPU engines
in align mode: a cold engine stores through our connector into a persistent ``fs://`` store, a fresh warm
engine hits it, and every answer (greedy tokens and top-5 logprobs) equals vLLM's without the connector.

The negative control skips the recurrent groups (``platforms.skip_groups``: hits still claimed, state not
restored): the same check must then fail. vLLM's own align-mode prefix caching is measured alongside.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.fork_server import run_module
from tests.integration.recurrent_model import ensure_tiny_qwen3_next

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

PREFIX = [(i * 37) % 2000 + 1 for i in range(512)]
A = PREFIX + [(i * 11) % 1900 + 7 for i in range(40)]  # shares two 256-token chunks
D = PREFIX[:256] + [(i * 13) % 1800 + 3 for i in range(300)]  # shares one chunk with A
E = PREFIX  # the whole prompt is stored: a hit must stop a chunk short (vLLM computes the last token)


def run_pass(model: Path, store: Path, mode: str, prompts: list[list[int]], skip_groups: str = "",
             max_num_batched_tokens: int = 256) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "PYTHONPATH": str(REPO)}
    proc = run_module("tests.integration.recurrent_run",
                      [str(model), str(store), mode, skip_groups, str(max_num_batched_tokens)], env, REPO,
                      timeout=400, input=json.dumps(prompts))
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1]) | {"log": proc.stderr}
    assert not any(e["degraded"] for e in result["health"])
    return result


def mismatches(got: dict, reference: dict) -> list[int]:
    """Requests whose greedy tokens or top-5 logprobs differ from the reference's, bit for bit."""
    return [i for i, (g, r) in enumerate(zip(got["runs"], reference["runs"], strict=True))
            if (g["tokens"], g["logprobs"]) != (r["tokens"], r["logprobs"])]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return ensure_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3-next-tiny"))


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> dict:
    return run_pass(model, tmp_path_factory.mktemp("unused"), "plain", [A, D, E])


def test_warm_engine_hits_every_stored_chunk_with_identical_answers(model, reference, tmp_path):
    cold = run_pass(model, tmp_path, "connector", [A, D])
    assert cold["hits_allowed"] and cold["plan"].count("MambaSpec") == 3
    assert [r["cached"] for r in cold["runs"]] == [0, 256]  # D hits A's first chunk (a partial prefix)
    assert (cold["chunks_stored"], cold["chunks_loaded"]) == (3, 1)
    assert mismatches(cold, {"runs": reference["runs"][:2]}) == []
    warm = run_pass(model, tmp_path, "connector", [A, D, E])
    assert [r["cached"] for r in warm["runs"]] == [512, 512, 256]
    assert warm["chunks_loaded"] == 5
    assert mismatches(warm, reference) == []


def test_negative_control_state_not_restored_is_caught(model, reference, tmp_path):
    cold = run_pass(model, tmp_path, "connector", [A, D], skip_groups="MambaSpec")
    warm = run_pass(model, tmp_path, "connector", [A, D, E], skip_groups="MambaSpec")
    assert "skipped group 0 (MambaSpec)" in warm["plan"]
    assert [r["cached"] for r in warm["runs"]][:2] == [512, 512]
    assert 1 in mismatches(cold, {"runs": reference["runs"][:2]})
    assert mismatches(warm, reference)[:2] == [0, 1]


def test_a_step_budget_spanning_blocks_claims_no_hit_and_says_which_setting(model, reference, tmp_path):
    """With a 4096-token budget vLLM runs A's first 512 tokens as one step, so no state exists at 256: the group
    stays unrestorable, nothing is stored (so nothing can ever hit), and the start-up log names the fix."""
    why = ("groups 0, 1, 2 (MambaSpec): max_num_batched_tokens 4096 lets one prefill step span several 256-token "
           "blocks, and vLLM keeps the state only where a step ends: set max_num_batched_tokens below 512 (e.g. 256)")
    result = run_pass(model, tmp_path, "connector", [A], max_num_batched_tokens=4096)
    assert not result["hits_allowed"] and result["why"] == why and why in result["log"]
    assert (result["chunks_stored"], result["chunks_loaded"]) == (0, 0)
    assert result["runs"][0]["tokens"] == reference["runs"][0]["tokens"]


def test_vllms_own_align_mode_prefix_caching_is_bit_exact_here(model, reference, tmp_path):
    own = run_pass(model, tmp_path, "align", [A, D, E, A])
    # vLLM keeps the state only at a few boundaries per prompt: D finds no 256-token hit there, ours does.
    assert [r["cached"] for r in own["runs"]] == [0, 0, 256, 512]
    assert mismatches({"runs": own["runs"][:3]}, reference) == []
    assert mismatches({"runs": own["runs"][3:]}, {"runs": reference["runs"][:1]}) == []
