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
from tests.fuzz.run import judge, model_dirs, pages_only, run_passes

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
def verdicts() -> dict[str, tuple[Case, list[str]]]:
    model = model_dirs(names=("hybrid",))["hybrid"]
    found: dict[str, tuple[Case, list[str]]] = {}
    for hma in (False, True):
        cases = {name: repro_case(*variant) for name, variant in VARIANTS.items() if variant[1] is hma}
        reference, passes, _ = run_passes(list(cases.values()), model)
        found |= {name: (case, judge(case, reference, result))
                  for (name, case), result in zip(cases.items(), passes, strict=True)}
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_first_repro_answers_as_a_reference_that_stored_nothing(verdicts, variant: str) -> None:
    case, problems = verdicts[variant]
    assert problems == []
    assert case.hit_tokens == 2 * 512  # B and A again: the document's four whole chunks each

