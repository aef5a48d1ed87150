"""The identity check: exact equality, bf16 ties shown by raw logits, and real differences."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.tools.demo.identity import bf16_step, compare


def _result(tokens: list[int], steps: list[dict[int, float]]) -> dict:
    return {"tokens": tokens, "top_logits": [[[t, v] for t, v in step.items()] for step in steps]}


def _next_bf16_away_from_zero(value: float) -> float:
    """One more in the magnitude bits (sign-magnitude format: the same +1 for either sign)."""
    bits = torch.tensor([value], dtype=torch.bfloat16).view(torch.int16)
    return float((bits + 1).view(torch.bfloat16))


@settings(max_examples=60, deadline=None)
@given(st.floats(min_value=-1e4, max_value=1e4, allow_nan=False).filter(lambda v: abs(v) > 1e-30))
def test_bf16_step_is_the_distance_to_the_next_bf16_number(value: float) -> None:
    exact = float(torch.tensor([value], dtype=torch.bfloat16))
    assert bf16_step(exact) == abs(_next_bf16_away_from_zero(exact) - exact)


def test_bf16_step_of_zero_and_infinity_is_tiny() -> None:
    assert bf16_step(0.0) == math.ulp(0.0)
    assert bf16_step(math.inf) == math.ulp(0.0)


def test_identical_tokens_are_identical_and_report_logit_drift() -> None:
    cold = _result([5, 6], [{5: 10.0, 7: 9.0}, {6: 8.0}])
    warm = _result([5, 6], [{5: 10.0 + bf16_step(10.0), 7: 9.0}, {6: 8.0}])
    verdict = compare(cold, warm)
    assert verdict.identical and not verdict.tie and verdict.equivalent
    assert verdict.first_difference is None
    assert verdict.max_logit_steps == 1.0
    assert verdict.describe() == "identical"


def test_divergence_at_a_one_step_tie_is_a_tie_not_identical() -> None:
    step = bf16_step(12.0)
    cold = _result([5, 3, 4], [{5: 9.0}, {3: 12.0 + step, 8: 12.0, 2: 1.0}, {4: 1.0}])
    warm = _result([5, 8, 1], [{5: 9.0}, {8: 12.0 + step, 3: 12.0 + step, 2: 1.0}, {1: 1.0}])
    verdict = compare(cold, warm)
    assert not verdict.identical and verdict.tie and verdict.equivalent
    assert verdict.first_difference == 1
    assert verdict.describe() == "bf16 tie at token 1"


def test_divergence_with_a_clear_logit_gap_is_different() -> None:
    cold = _result([3], [{3: 12.0, 8: 11.0}])
    warm = _result([8], [{8: 12.0, 3: 11.0}])
    verdict = compare(cold, warm)
    assert not verdict.equivalent
    assert verdict.describe() == "DIFFERENT from token 0"


def test_a_tied_pick_missing_from_one_top_k_is_not_a_tie() -> None:
    cold = _result([3], [{3: 12.0, 2: 1.0}])
    warm = _result([8], [{8: 12.0, 3: 12.0}])
    assert not compare(cold, warm).tie


def test_ties_need_the_shared_logits_to_agree_across_passes() -> None:
    cold = _result([3], [{3: 12.0, 8: 12.0, 2: 1.0}])
    warm = _result([8], [{8: 12.0, 3: 12.0, 2: 2.0}])
    assert not compare(cold, warm).tie


def test_a_shorter_output_differs_where_it_ends() -> None:
    verdict = compare(_result([1, 2], [{1: 1.0}, {2: 1.0}]), _result([1], [{1: 1.0}]))
    assert verdict.first_difference == 1 and not verdict.equivalent
