"""The soak's oracle against the server without a connector: identical answers, or answers parting only at a
proven bf16 tie (concurrent batches), within the logit drift bound; anything else is a difference."""

from __future__ import annotations

from lmcache_platforms.tools.demo.identity import bf16_step
from lmcache_platforms.tools.soak import MAX_LOGIT_DRIFT_BF16_STEPS, equivalent


def _result(tokens: list[int], steps: list[dict[int, float]]) -> dict:
    return {"tokens": tokens, "top_logits": [[[t, v] for t, v in step.items()] for step in steps]}


def test_answers_parting_at_a_bf16_tie_are_equivalent() -> None:
    step = bf16_step(12.0)
    reference = _result([5, 3, 4], [{5: 9.0}, {3: 12.0 + step, 8: 12.0}, {4: 1.0}])
    served = _result([5, 8, 1], [{5: 9.0}, {8: 12.0 + step, 3: 12.0 + step}, {1: 1.0}])
    assert equivalent(reference, served) == (True, "bf16 tie at token 1, max logit drift 1.0 bf16 steps")


def test_a_clear_gap_and_a_drift_beyond_the_bound_are_differences() -> None:
    assert equivalent(_result([3], [{3: 12.0, 8: 11.0}]), _result([8], [{8: 12.0, 3: 11.0}]))[0] is False
    drift = (MAX_LOGIT_DRIFT_BF16_STEPS + 1) * bf16_step(10.0)
    same_tokens = equivalent(_result([5], [{5: 10.0}]), _result([5], [{5: 10.0 + drift}]))
    assert same_tokens == (False, "identical, max logit drift 3.0 bf16 steps")
