"""The fuzzer's answer comparison on answers of different lengths (a request that failed answers nothing): a
difference it reports, where it used to stop the whole run."""

from __future__ import annotations

from tests.fuzz.run import _drift, _first_difference

REFERENCE = {"tokens": [5, 6, 7], "logprobs": [[[5, -0.5]], [[6, -0.25]], [[7, -0.125]]]}
NOTHING = {"tokens": [], "logprobs": []}
CUT = {"tokens": [5, 6], "logprobs": REFERENCE["logprobs"][:2]}


def test_an_answer_cut_short_is_a_difference_both_ways() -> None:
    assert _first_difference(REFERENCE, NOTHING) == "0 tokens answered, the reference 3"
    assert _first_difference(REFERENCE, CUT) == "2 tokens answered, the reference 3"
    assert _drift(REFERENCE, NOTHING, 2.0) == (0.0, "0 tokens answered, the reference 3")


def test_the_same_answer_is_no_difference() -> None:
    assert _first_difference(REFERENCE, dict(REFERENCE)) is None
    assert _drift(REFERENCE, dict(REFERENCE), 2.0) == (0.0, None)
