"""Are the warm pass's tokens the cold pass's tokens, and if not, is it an exact bf16 tie?

Reused KV is a bit-exact copy, but the warm pass prefills only the tail of each prompt, in different shapes,
so the last hidden state can differ in the last bits; on a random-weight model two candidates can then have
logits one bf16 step apart and greedy decoding may pick either. Such a divergence is reported as a tie, only
when the engine's raw logits show it, and never counted as identical.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

BF16_MANTISSA_BITS = 7


def bf16_step(value: float) -> float:
    """Distance from ``value`` to the next bf16 number away from zero (one unit in the last place)."""
    if value == 0.0 or not math.isfinite(value):
        return math.ulp(0.0)
    _, exponent = math.frexp(value)
    return math.ldexp(1.0, exponent - 1 - BF16_MANTISSA_BITS)


@dataclass(frozen=True)
class Verdict:
    """``identical``: every token equal. ``tie``: they first differ at ``first_difference`` where both passes'
    raw logits put the two chosen tokens within one bf16 step of each other. ``max_logit_steps``: the largest
    difference, in bf16 steps, of any top-k logit seen by both passes up to that point."""

    identical: bool
    tie: bool
    first_difference: int | None
    max_logit_steps: float

    @property
    def equivalent(self) -> bool:
        return self.identical or self.tie

    def describe(self) -> str:
        if self.identical:
            return "identical"
        if self.tie:
            return f"bf16 tie at token {self.first_difference}"
        return f"DIFFERENT from token {self.first_difference}"


def _as_map(step: list[list[float]]) -> dict[int, float]:
    return {int(token): float(logit) for token, logit in step}


def _steps_apart(a: float, b: float) -> float:
    return abs(a - b) / bf16_step(max(abs(a), abs(b)))


def _max_steps(cold: dict[int, float], warm: dict[int, float]) -> float:
    return max((_steps_apart(cold[t], warm[t]) for t in cold.keys() & warm.keys()), default=0.0)


def _is_tie(cold: dict[int, float], warm: dict[int, float], cold_pick: int, warm_pick: int) -> bool:
    """Both picks are in both passes' top-k, within one bf16 step of each other in each pass, and every
    top-k logit the passes share agrees within one bf16 step."""
    if not {cold_pick, warm_pick} <= cold.keys() & warm.keys():
        return False
    picks_tied = all(_steps_apart(logits[cold_pick], logits[warm_pick]) <= 1.0 for logits in (cold, warm))
    return picks_tied and _max_steps(cold, warm) <= 1.0


def compare(cold: dict[str, Any], warm: dict[str, Any]) -> Verdict:
    """Compare one request's results (``tokens`` and ``top_logits`` per generated token) from two passes."""
    cold_tokens, warm_tokens = cold["tokens"], warm["tokens"]
    first = next((i for i, (a, b) in enumerate(zip(cold_tokens, warm_tokens, strict=False)) if a != b), None)
    if first is None and len(cold_tokens) != len(warm_tokens):
        first = min(len(cold_tokens), len(warm_tokens))
    last = len(cold_tokens) - 1 if first is None else first
    max_steps = 0.0
    for position in range(min(last + 1, len(cold["top_logits"]), len(warm["top_logits"]))):
        step_max = _max_steps(_as_map(cold["top_logits"][position]), _as_map(warm["top_logits"][position]))
        max_steps = max(max_steps, step_max)
    if first is None:
        return Verdict(True, False, None, max_steps)
    tie = (
        first < min(len(cold_tokens), len(warm_tokens))
        and first < min(len(cold["top_logits"]), len(warm["top_logits"]))
        and _is_tie(_as_map(cold["top_logits"][first]), _as_map(warm["top_logits"][first]),
                    cold_tokens[first], warm_tokens[first])
    )
    return Verdict(False, tie, first, max_steps)
