"""How the client reads a streamed choice: token ids and ranked raw logits, and a null logit (the JSON form of
NaN or an infinity) refused by name instead of surfacing as a ``float(None)`` TypeError."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from lmcache_platforms.tools.demo.client import choice_tokens


def _choice(step: dict[str, float | None]) -> SimpleNamespace:
    return SimpleNamespace(logprobs=SimpleNamespace(tokens=["token_id:7"], top_logprobs=[step]))


def test_a_choice_gives_its_token_and_logits_ranked_high_to_low_ties_by_id() -> None:
    got = choice_tokens(_choice({"token_id:9": 1.5, "token_id:7": 2.0, "token_id:3": 1.5}))
    assert got == ([7], [[[7, 2.0], [3, 1.5], [9, 1.5]]])


def test_a_null_logit_is_refused_as_nan_or_infinite() -> None:
    with pytest.raises(ValueError, match=r"null logit .*'token_id:3': None.*NaN or an infinity"):
        choice_tokens(_choice({"token_id:7": 2.0, "token_id:3": None}))
