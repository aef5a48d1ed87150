"""The workload that found the hybrid-manager-off load bug, as its report gave it: a Gemma-3-style hybrid (6
layers, 4 sliding over 96 tokens), LMCache chunk 128 on its CPU tier, vLLM's prefix cache off, greedy, 16 tokens
with top logprobs: A (a 520-token document, then 30 more), B (the document, then 61 others), C (300 unrelated),
D (17), then A again, after C and D reused A's blocks. Under all three connector names (the upstream ones turn
vLLM's hybrid manager off) and ours with it on and off, under poisoned blocks, every answer must equal a
reference that stored nothing bit for bit, and the hits must be exactly the document's whole chunks. Each side
of the hybrid manager has its reference: with nothing loaded, vLLM's CPU attention computes this model alike
with the manager on or off on its AMX path, but not on its ``vec`` path (a decode step 10 tokens into the
unrelated prompt C rounded otherwise)."""

from __future__ import annotations

import random

import pytest

from tests.fuzz.cases import DIMENSIONS, Case
from tests.fuzz.run import Result, judge, model_dirs, pages_only, run_passes

pytestmark = pytest.mark.slow

VARIANTS = {"ours, hybrid manager on": ("LMCachePlatformsConnector", True),
            "ours, hybrid manager off": ("LMCachePlatformsConnector", False),
            "LMCacheConnectorV1": ("LMCacheConnectorV1", False),
            "LMCacheConnectorV1Dynamic": ("LMCacheConnectorV1Dynamic", False)}


def repro_case(connector: str, hma: bool) -> Case:
    rng = random.Random(58)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1, 2000) for _ in range(n)]

    doc = tokens(520)
    a = doc + tokens(30)
    batches = [[a], [doc + tokens(61)], [tokens(300)], [tokens(17)], [a]]
    settings = {"model": "hybrid", "connector": connector, "hma": hma, "chunk_size": 128, "block_size": None,
                "chunk_parts": "window", "chunk_rows": "blocks" if pages_only() else "tokens", "load_mode": "sync",
                "layerwise": False, "tier": "cpu", "roles": "both", "prefix_caching": False,
                "kv_cache_dtype": "auto", "kv_cache": "roomy"}
    assert settings.keys() == DIMENSIONS.keys()
    return Case(58, settings, batches)


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[Case, list[str], Result]]:
    model = model_dirs(names=("hybrid",))["hybrid"]
    found: dict[str, tuple[Case, list[str], Result]] = {}
    for hma in (False, True):
        cases = {name: repro_case(*variant) for name, variant in VARIANTS.items() if variant[1] is hma}
        reference, passes, _ = run_passes(list(cases.values()), model)
        found |= {name: (case, judge(case, reference, result), result["case"])
                  for (name, case), result in zip(cases.items(), passes, strict=True)}
    return found


@pytest.fixture(scope="module")
def prefix_cached() -> dict[bool, Result]:
    """Per side of the hybrid manager, vLLM's own prefix cache on the same workload, nothing stored or loaded
    (the reference pass of a case with prefix caching on): it resumes B and A again after 512 cached tokens, as
    LMCache's four whole chunks do."""
    model = model_dirs(names=("hybrid",))["hybrid"]
    found: dict[bool, Result] = {}
    for hma in (False, True):
        case = repro_case("LMCachePlatformsConnector", hma)
        case.settings["prefix_caching"] = True
        found[hma] = run_passes([case], model)[0]
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_first_repro_answers_as_a_reference_that_stored_nothing(verdicts, variant: str) -> None:
    """Bit for bit where vLLM's CPU attention resumes a prefill in the same arithmetic as a cold one (its AMX
    path); elsewhere a resumed request is held to the oracle's drift bound (``resume_rounds_otherwise``)."""
    case, problems, _ = verdicts[variant]
    assert problems == []
    assert case.hit_tokens == 2 * 512  # B and A again: the document's four whole chunks each


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_first_repro_answers_as_vllms_own_prefix_cache(verdicts, prefix_cached, variant: str) -> None:
    """Bit for bit on every CPU: the same resumes from vLLM's own prefix cache give the same bytes (tokens and
    top logprobs of all 16 generated tokens)."""
    case, _, answers = verdicts[variant]
    own = prefix_cached[case.settings["hma"]]
    assert isinstance(own, dict) and isinstance(answers, dict), (own, answers)
    assert [a["batch_hits"]["vllm"] for a in own["answers"]] == [0, 512, 0, 0, 512]
    assert [(a["tokens"], a["logprobs"]) for a in answers["answers"]] == [
        (a["tokens"], a["logprobs"]) for a in own["answers"]]
