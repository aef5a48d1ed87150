"""The workload is deterministic, shares its system prompt, and fits the model."""

from __future__ import annotations

import pytest

from lmcache_platforms.tools.demo.model import MODELS
from lmcache_platforms.tools.demo.workload import (
    DEMO_WORKLOAD,
    FIRST_ORDINARY_TOKEN,
    WORKLOADS,
    build_workload,
    warmup_request,
)


@pytest.mark.parametrize("size", sorted(WORKLOADS))
def test_requests_share_the_system_prompt_and_fit_the_model(size: str) -> None:
    spec, model = WORKLOADS[size], MODELS[size]
    requests = build_workload(spec, model.vocab_size)
    assert len(requests) == spec.requests
    assert len({r.name for r in requests}) == spec.requests
    system = requests[0].tokens[: spec.system_tokens]
    low, high = spec.question_tokens
    for request in requests:
        assert request.tokens[: spec.system_tokens] == system
        assert spec.system_tokens + spec.document_tokens + low <= len(request.tokens)
        assert len(request.tokens) <= spec.system_tokens + spec.document_tokens + high
        assert len(request.tokens) + spec.max_tokens <= model.max_model_len
        assert all(FIRST_ORDINARY_TOKEN <= t < model.vocab_size for t in request.tokens)
    documents = {tuple(r.tokens[spec.system_tokens:]) for r in requests}
    assert len(documents) == spec.requests


def test_same_spec_same_requests() -> None:
    assert build_workload(DEMO_WORKLOAD, 8192) == build_workload(DEMO_WORKLOAD, 8192)


def test_demo_prompts_are_2048_tokens_plus_a_question_shorter_than_a_block() -> None:
    spec = DEMO_WORKLOAD
    assert spec.system_tokens + spec.document_tokens == 2048
    assert spec.question_tokens[1] < 32


def test_warmup_differs_per_salt_and_has_the_requested_length() -> None:
    a, b = warmup_request(300, 2048, "cold"), warmup_request(300, 2048, "warm")
    assert len(a.tokens) == len(b.tokens) == 300
    assert a.tokens != b.tokens
    assert a == warmup_request(300, 2048, "cold")


def test_vocab_too_small_is_refused() -> None:
    with pytest.raises(ValueError, match="vocab_size must exceed 16, got 16"):
        build_workload(DEMO_WORKLOAD, 16)
