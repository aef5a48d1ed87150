"""A GDN hybrid (tiny random Qwen3-Next: 3 recurrent layers + 1 full-attention layer, vLLM block 256 tokens) in
real vLLM CPU engines in align mode, at the step budgets users run (vLLM's default unless a test names one); each
other hybrid vLLM's CPU build runs in align mode (``recurrent_model.MODELS``) through one cold and one warm engine.

vLLM keeps a recurrent state only where a step ended; our connector saves a chunk's state part exactly there and
claims a hit only up to a chunk carrying one. Every answer (greedy tokens and top-5 logprobs) is compared, bit for
bit, with vLLM's without a connector (prefix caching off); planted faults show the comparison catches a state
from the wrong position and a state not restored.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from lmcache_platforms.integration.vllm.recurrent import chunk_size_for
from lmcache_platforms.tools.redis_server import RedisServer
from tests.fork_server import run_module
from tests.integration.recurrent_model import MODELS, ensure_tiny, ensure_tiny_qwen3_next
from tests.session_cache import cached, folder_digest, session_folder

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

TURN_ONE = [(i * 37) % 2000 + 1 for i in range(1100)]
LONG = [(i * 37) % 2000 + 1 for i in range(9000)]
LONG_BRANCH = LONG[:7000] + [(i * 13) % 1800 + 3 for i in range(200)]  # 27 whole chunks shared with LONG
PREFIX = [(i * 37) % 2000 + 1 for i in range(512)]
A = PREFIX + [(i * 11) % 1900 + 7 for i in range(40)]
EXTENDED = TURN_ONE + [(i * 11) % 1900 + 7 for i in range(200)]
STORED = re.compile(r"request (\S+): stored tokens \[(\d+), (\d+)\) in LMCache, \d+ bytes written, "
                    r"recurrent state at \[([\d, ]*)\]")


def run_pass(model: Path, store: Path, mode: str, job: dict) -> dict:
    # INFO: the tests read the connector's "stored tokens" lines, whatever level the caller's environment sets.
    env = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", "LMCACHE_LOG_LEVEL": "INFO",
           "PYTHONPATH": str(REPO)}
    proc = run_module("tests.integration.recurrent_run", [str(model), str(store), mode], env, REPO, timeout=400,
                      input=json.dumps(job), engine=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1]) | {"log": proc.stderr}
    assert not any(e["degraded"] for e in result["health"])
    # With "forget" the next prompt may hit LMCache only: a reset vLLM refused would let it hit vLLM's own cache.
    refused = [i for i, run in enumerate(result["runs"]) if run.get("forgotten") is False]
    assert not refused, f"vLLM refused to reset its prefix cache after prompts {refused}"
    return result


def state_ends(result: dict) -> list[int]:
    """Where the pass stored a state part, in order, from the connector's log."""
    return [int(end) for m in STORED.finditer(result["log"]) for end in m.group(4).split(", ") if end]


def same_answer(got: dict, reference: dict) -> bool:
    """Greedy tokens and top-5 logprobs equal, bit for bit."""
    return (got["tokens"], got["logprobs"]) == (reference["tokens"], reference["logprobs"])


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return ensure_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3-next-tiny"))


@pytest.fixture(scope="module")
def turn_one(model, tmp_path_factory) -> dict:
    """A 1,100-token prompt and 300 generated tokens through the connector into an ``fs://`` store."""
    store = tmp_path_factory.mktemp("turn-one")
    result = run_pass(model, store, "connector", {"prompts": [TURN_ONE], "max_tokens": 300})
    return result | {"store": store, "turn_two": TURN_ONE + result["runs"][0]["tokens"] + A[:100]}


def turn_one_store(turn_one: dict, folder: Path) -> Path:
    """A copy of turn one's ``fs://`` store for one test: a pass that hits it also stores what it computed past the
    hit (turn two's chunk ending at 1,280, with its state), which would move the next test's hit there."""
    return Path(shutil.copytree(turn_one["store"], folder / "turn-one-store"))


def plain_answer(model: Path, prompt: list[int], folder: Path) -> dict:
    """vLLM's answer without a connector (prefix caching off) to one prompt, alone in its engine."""
    return run_pass(model, folder, "plain", {"prompts": [prompt]})["runs"][0]


def reference_answer(model: Path, prompt: list[int], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``plain_answer``, computed once per session: the test groups of this module run on either worker
    (tests/conftest.py splits it) and several compare with the same answer."""
    key = {"run": "tests.integration.recurrent_run plain", "model": folder_digest(model), "prompt": prompt}
    return cached(session_folder(tmp_path_factory), key,
                  lambda: plain_answer(model, prompt, tmp_path_factory.mktemp("unused")))


@pytest.fixture(scope="module")
def reference(model, turn_one, tmp_path_factory) -> dict:
    return reference_answer(model, turn_one["turn_two"], tmp_path_factory)


@pytest.fixture(scope="module")
def aligned_long_branch(model, tmp_path_factory):
    """LONG_BRANCH answered by vLLM alone in align mode at a step budget (0: vLLM's default), computed once per
    session: the reference of a hit at that budget. vLLM's CPU kernels keep per-block states in align mode and so
    run the prompt in other pieces than without prefix caching; on CPUs whose kernels round those pieces
    differently (AMX) only the same mode and budget answer bit for bit alike."""

    def answer(budget: int) -> dict:
        key = {"run": "tests.integration.recurrent_run align", "model": folder_digest(model), "prompt": LONG_BRANCH,
               "budget": budget}
        return cached(session_folder(tmp_path_factory), key, lambda: run_pass(
            model, tmp_path_factory.mktemp("unused"), "align", {"prompts": [LONG_BRANCH], "budget": budget})["runs"][0])

    return answer


@pytest.fixture(scope="module")
def reference_a(model, tmp_path_factory) -> dict:
    return reference_answer(model, A, tmp_path_factory)


def test_turn_one_stores_the_state_where_vllm_kept_one(turn_one):
    """vLLM's default budget (4,096) runs the prompt as [0, 1024) then [1024, 1100) (it stops at the prompt's
    last block boundary): the one state is at 1024; decode chunks are not saved (save_decode_cache off). vLLM's
    block for this model depends on the CPU (256 with AVX-512, 128 without): the start-up line names the one the
    run reports."""
    assert turn_one["hits_allowed"] and turn_one["chunk_size"] == 256 and turn_one["plan"].count("MambaSpec") == 3
    assert state_ends(turn_one) == [1024]
    assert [m.group(2, 3) for m in STORED.finditer(turn_one["log"])] == [("0", "1024")]
    chunk, line = chunk_size_for(256, [turn_one["block_size"]])
    assert chunk == 256 and line in turn_one["log"]


def test_turn_two_in_a_fresh_engine_hits_up_to_the_last_state(model, turn_one, reference, tmp_path):
    """Past the hit vLLM computes to the prompt's last block boundary and keeps a state there (1,280 with blocks of
    256; 1,408 with blocks of 128, inside a chunk: no chunk ends at a state then)."""
    warm = run_pass(model, turn_one_store(turn_one, tmp_path), "connector", {"prompts": [turn_one["turn_two"]]})
    assert warm["runs"][0]["cached"] == 1024 and warm["chunks_loaded"] == 4
    last = (len(turn_one["turn_two"]) - 1) // warm["block_size"] * warm["block_size"]
    assert state_ends(warm) == ([last] if last % warm["chunk_size"] == 0 else [])
    assert same_answer(warm["runs"][0], reference)


@pytest.mark.redis
def test_turn_two_through_redis(model, turn_one, reference, tmp_path):
    """The same through a Redis remote store (its values sized from each part's own metadata)."""
    with RedisServer(str(tmp_path)) as redis:
        job = {"extra": {"lmcache.local_cpu": False, "lmcache.remote_url": redis.url}}
        cold = run_pass(model, tmp_path, "connector", job | {"prompts": [TURN_ONE], "max_tokens": 1})
        warm = run_pass(model, tmp_path, "connector", job | {"prompts": [turn_one["turn_two"]]})
    assert state_ends(cold) == [1024]
    assert warm["runs"][0]["cached"] == 1024
    assert same_answer(warm["runs"][0], reference)


# Per budget: where LONG's prefill steps end (each a kept state), and the longest of those within the 27 chunks
# LONG_BRANCH shares with it. vLLM always stops at the prompt's last block boundary (8,960).
BUDGETS = {
    512: ([*range(512, 8704 + 1, 512), 8960], 6656),
    2048: ([2048, 4096, 6144, 8192, 8960], 6144),
    0: ([4096, 8192, 8960], 4096),  # vLLM's default for LLM on CPU: 4,096
}


@pytest.mark.parametrize("budget", [2048, 0])
def test_a_long_prompt_hits_at_the_last_state_for_every_budget(model, aligned_long_branch, tmp_path, budget):
    """At 2,048 the user's LMCache chunk size is 96, no multiple of vLLM's block (128 or 256, by CPU): the block
    replaces it. The state positions are the same for either block."""
    ends, hit = BUDGETS[budget]
    extra = {"lmcache.chunk_size": 96} if budget == 2048 else {}
    result = run_pass(model, tmp_path, "connector",
                      {"prompts": [LONG, LONG_BRANCH], "budget": budget, "forget": True, "extra": extra})
    block = result["block_size"]
    assert result["chunk_size"] == (block if extra else 256)
    if extra:
        assert (f"recurrent state groups: LMCache chunk_size 96 is not a multiple of vLLM's block of {block} "
                f"tokens, where the states are kept; using chunk_size {block}") in result["log"]
    assert state_ends(result)[: len(ends)] == ends
    assert [r["cached"] for r in result["runs"]] == [0, hit]
    assert same_answer(result["runs"][1], aligned_long_branch(budget))


def test_at_budget_512_and_a_state_part_gone_the_hit_falls_back_to_the_previous_state(model, aligned_long_branch,
                                                                                       tmp_path):
    """Budget 512 as above; then the state parts of the chunks ending at 6,656 (LONG's) and 7,168 (the branch's
    own, stored by its first run) are removed from every tier, their attention parts stay: the same request hits
    the state at 6,144 instead, with the same answer."""
    ends, hit = BUDGETS[512]
    job = {"prompts": [LONG, LONG_BRANCH, LONG_BRANCH], "budget": 512, "forget": True,
           "evict": [{"after": 1, "prompt": 0, "ends": [6656]}, {"after": 1, "prompt": 1, "ends": [7168]}]}
    result = run_pass(model, tmp_path, "connector", job)
    assert state_ends(result)[: len(ends)] == ends
    assert result["runs"][1]["evicted"] == 4  # two objects, each in local CPU and fs://
    assert [r["cached"] for r in result["runs"]] == [0, hit, 6144]
    assert same_answer(result["runs"][1], aligned_long_branch(512))
    assert same_answer(result["runs"][2], aligned_long_branch(512))


def test_negative_control_a_state_from_the_wrong_position_is_caught(model, aligned_long_branch, tmp_path):
    """Planted: each state is also stored one chunk early, so LONG_BRANCH hits at 6,912 with 7,168's state."""
    result = run_pass(model, tmp_path, "connector",
                      {"prompts": [LONG, LONG_BRANCH], "budget": 512, "forget": True, "plant_early_states": True})
    assert result["runs"][1]["cached"] == 6912
    assert not same_answer(result["runs"][1], aligned_long_branch(512))


def test_negative_control_state_not_restored_is_caught(model, reference_a, tmp_path):
    """The recurrent groups skipped (``platforms.skip_groups``: hits still claimed, state not restored)."""
    result = run_pass(model, tmp_path, "connector", {"prompts": [A, A], "budget": 256, "forget": True,
                                                      "extra": {"platforms.skip_groups": "MambaSpec"}})
    assert "skipped group 0 (MambaSpec)" in result["plan"]
    assert [r["cached"] for r in result["runs"]] == [0, 512]
    assert same_answer(result["runs"][0], reference_a) and not same_answer(result["runs"][1], reference_a)


def test_vllms_own_align_mode_prefix_caching_hits_where_ours_does(model, turn_one, reference, tmp_path):
    """vLLM's own prefix cache keeps the same states: in one engine, turn two hits 1,024 there too (turn one's
    prefill leaves that state whatever it generates next, so one token of it is enough here)."""
    own = run_pass(model, tmp_path, "align", {"prompts": [TURN_ONE, turn_one["turn_two"]], "max_tokens": [1, 6]})
    assert [r["cached"] for r in own["runs"]] == [0, 1024]
    assert same_answer(own["runs"][1], reference)


def test_chunks_stored_whole_carry_a_state_each_and_hit_where_every_chunk_kept_one(model, reference_a, tmp_path):
    """``platforms.chunk_parts: whole``: a chunk is stored only with its state; at a one-block budget every
    chunk keeps one, so the whole prefix hits, and the start-up log says what whole chunks cost."""
    result = run_pass(model, tmp_path, "connector", {"prompts": [A, A], "budget": 256, "forget": True,
                                                      "extra": {"platforms.chunk_parts": "whole"}})
    assert "recurrent state groups with chunks stored whole" in result["log"]
    assert state_ends(result) == [256, 512]
    assert [r["cached"] for r in result["runs"]] == [0, 512]
    assert same_answer(result["runs"][0], reference_a) and same_answer(result["runs"][1], reference_a)


def test_a_cached_answer_is_the_one_computed_afresh(model, reference_a, tmp_path):
    """The answers without a connector come from the session's cache, whichever worker computed them: a fresh
    engine gives the same (the negative controls above show the comparison tells answers apart)."""
    assert same_answer(plain_answer(model, A, tmp_path), reference_a)


@pytest.mark.parametrize("name", sorted(set(MODELS) - {"qwen3-next"}))
def test_another_hybrid_hits_at_its_last_state_in_a_fresh_engine(name, tmp_path_factory):
    """vLLM's default budget (4,096) prefills the 1,100-token prompt up to its last block boundary, then the rest:
    with that boundary on a chunk boundary, the state is stored there; a fresh engine on a longer prompt extending
    it hits exactly there. Positions come from the block and chunk sizes the run reports, not from Qwen3-Next's.

    The answer is bit-identical to vLLM's own align-mode prefix cache hitting at the same position. Against vLLM
    without prefix caching only the greedy tokens are compared: on LFM2 vLLM's logprobs there differ in the 4th
    digit from both (a run with the same 1,024-token step split too), so the difference is vLLM's, not a state
    restored wrong. Negative control: the recurrent groups skipped (hit claimed, state not restored) moves the
    logprobs by as little, and the comparison with vLLM's own cache catches it."""
    model = ensure_tiny(name, tmp_path_factory.mktemp(name))
    store = tmp_path_factory.mktemp(f"{name}-store")
    cold = run_pass(model, store, "connector", {"prompts": [TURN_ONE], "max_tokens": 1})
    block, chunk = cold["block_size"], cold["chunk_size"]
    step_end = len(TURN_ONE) // block * block
    assert cold["hits_allowed"] and "MambaSpec" in cold["plan"] and step_end % chunk == 0
    assert state_ends(cold) == [step_end]
    warm = run_pass(model, store, "connector", {"prompts": [EXTENDED]})
    assert warm["runs"][0]["cached"] == step_end and warm["chunks_loaded"] == step_end // chunk
    unused = tmp_path_factory.mktemp(f"{name}-unused")
    own = run_pass(model, unused, "align", {"prompts": [TURN_ONE, EXTENDED], "max_tokens": [1, 6]})
    assert own["runs"][1]["cached"] == step_end
    assert same_answer(warm["runs"][0], own["runs"][1])
    assert warm["runs"][0]["tokens"] == run_pass(model, unused, "plain", {"prompts": [EXTENDED]})["runs"][0]["tokens"]
    skipped = run_pass(model, tmp_path_factory.mktemp(f"{name}-skipped"), "connector",
                       {"prompts": [TURN_ONE, EXTENDED], "max_tokens": [1, 6], "forget": True,
                        "extra": {"platforms.skip_groups": "MambaSpec"}})
    assert skipped["runs"][1]["cached"] == step_end and not same_answer(skipped["runs"][1], own["runs"][1])


def test_layerwise_mode_hits_what_the_paged_mode_stored_and_what_it_stored_itself(model, turn_one, reference,
                                                                                   reference_a, tmp_path):
    """LMCache's ``use_layerwise`` on the recurrent hybrid: turn one's chunks (stored paged) hit at the same state;
    a prompt stored in layerwise mode (attention layers copied as the forward marks them; the GDN layers, which
    vLLM gives no per-layer hook, once the forward ends) hits at its last state with vLLM's answer. Loads wait
    (several groups), so none runs layer by layer."""
    result = run_pass(model, turn_one_store(turn_one, tmp_path), "connector",
                      {"prompts": [turn_one["turn_two"], PREFIX, A], "forget": True,
                       "extra": {"lmcache.use_layerwise": True}})
    assert "layerwise: stores follow the forward" in result["log"]
    turn_two, prefix, a = result["runs"]
    assert turn_two["cached"] == 1024 and same_answer(turn_two, reference)
    prefix_ends = [end for end in state_ends(result) if end <= len(PREFIX)]
    assert prefix["cached"] == 0 and prefix_ends and prefix_ends[-1] in (256, 512)
    assert a["cached"] == prefix_ends[-1] and same_answer(a, reference_a)
    assert result["layers_stored"] > 0 and result["layers_loaded"] == 0  # layer counts: per store call and part
