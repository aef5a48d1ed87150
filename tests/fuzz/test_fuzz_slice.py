"""The fuzzer's seeded slice in the suite, with its negative controls: one workload that goes looking for stale
rows (a prompt back after others reused its blocks, a branch off a shared document, lengths on window and
chunk edges, a concurrent batch that outgrows a tight KV cache so vLLM preempts a request it loaded and leaves
one it looked up waiting for blocks until its client aborts it, a request its client aborts while its load is in
flight), on a sliding-window hybrid with vLLM's hybrid manager on and loads while requests wait, compared with a
reference that stored nothing, and no chunk left pinned; the same workload with a sliding window part's last
row dropped, with every 32nd and the last row of each chunk neither stored nor loaded under poisoned blocks, and
with writes into a preempted request's blocks after vLLM handed them on (and a finished request's pins kept),
must fail the same oracle.

``make fuzz`` runs the random search (``tests/fuzz/run.py``); this slice keeps its oracle honest in CI.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from tests.fuzz.cases import DIMENSIONS, WINDOW, Case
from tests.fuzz.run import judge, model_dirs, pages_only, run_passes

pytestmark = pytest.mark.slow

CHUNK = 128
PLANTED = ("window-off-by-one", "skip-row", "stale-after-preemption+pins-kept")


def control_case() -> Case:
    rng = random.Random(58)
    doc = [rng.randrange(1, 2000) for _ in range(2 * CHUNK + 8)]

    def tail(n: int) -> list[int]:
        return [rng.randrange(1, 2000) for _ in range(n)]

    a = doc + tail(30)
    long = [tail(1000), tail(900)]
    batches = [[a], [doc[:CHUNK + WINDOW] + tail(61)], [tail(300)], [tail(17)], [a], [*long, a, doc + tail(5)],
               [tail(40), doc + tail(90)], [a]]
    settings = {"model": "hybrid", "connector": "LMCachePlatformsConnector", "hma": True, "chunk_size": CHUNK,
                "block_size": 64, "chunk_parts": "window", "chunk_rows": "blocks" if pages_only() else "tokens",
                "load_mode": "async", "layerwise": False, "tier": "cpu", "prefix_caching": False,
                "kv_cache_dtype": "auto", "kv_cache": "tight",
                "roles": "both"}
    assert settings.keys() == DIMENSIONS.keys()
    return Case(58, settings, batches, aborted=[6], aborted_waiting=[5])


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[Case, list[str]]]:
    clean = control_case()
    variants = {"clean": clean, **{plant: replace(clean, plant=plant) for plant in PLANTED}}
    reference, results, _ = run_passes(list(variants.values()), model_dirs(names=("hybrid",))["hybrid"])
    return {name: (case, judge(case, reference, result))
            for (name, case), result in zip(variants.items(), results, strict=True)}


def test_loads_under_poisoned_blocks_answer_as_a_reference_that_stored_nothing(verdicts) -> None:
    clean, problems = verdicts["clean"]
    assert problems == []
    assert clean.preemptions >= 1  # the concurrent batch outgrew the cache
    assert clean.waiting_aborts == 1  # its last request was looked up, left waiting, then aborted
    assert clean.hit_tokens > 0


@pytest.mark.parametrize("plant", PLANTED)
def test_a_planted_fault_fails_the_oracle(verdicts, plant: str) -> None:
    _, problems = verdicts[plant]
    assert any("differ" in problem or "drift" in problem for problem in problems), problems


def test_a_finished_requests_pins_kept_fail_the_oracle(verdicts) -> None:
    """The leak the fuzzer found (seed 1203): without the worker's release, the request aborted while it waited
    for blocks keeps its lookup's chunks pinned, and the pass says so."""
    case, problems = verdicts["stale-after-preemption+pins-kept"]
    assert case.waiting_aborts == 1
    assert any("still pinned" in problem for problem in problems), problems
