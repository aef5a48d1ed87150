"""The demo's requests: a shared system prompt, one long document per request, a short question.

It mimics several users asking about their own documents behind one system prompt: every request shares a
prefix with the others, and each carries a long part of its own, so the first (cold) pass really prefills and
the second (warm) pass, in a fresh engine, can only be fast if LMCache kept the KV cache. Token ids are random
but fixed by the seed, so both passes (and every configuration compared) see the very same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class WorkloadSpec:
    """Sizes in tokens; a request is ``system + document + question``."""

    requests: int
    system_tokens: int
    document_tokens: int
    question_tokens: tuple[int, int]
    max_tokens: int
    seed: int = 1234


@dataclass(frozen=True)
class Request:
    name: str
    tokens: list[int]


# Token ids below this are left out: Gemma keeps the low ids for pad/eos/bos and other special tokens.
FIRST_ORDINARY_TOKEN = 16

# 2,048-token shared-plus-own prefix per request; questions shorter than one 32-token block.
DEMO_WORKLOAD = WorkloadSpec(requests=6, system_tokens=512, document_tokens=1536, question_tokens=(8, 31),
                             max_tokens=16)
TINY_WORKLOAD = WorkloadSpec(requests=3, system_tokens=64, document_tokens=192, question_tokens=(4, 20),
                             max_tokens=8)
WORKLOADS = {"demo": DEMO_WORKLOAD, "tiny": TINY_WORKLOAD}


def _random_tokens(rng: random.Random, count: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(count)]


def build_workload(spec: WorkloadSpec, vocab_size: int) -> list[Request]:
    """The requests of ``spec``, identical for every call with the same arguments."""
    if vocab_size <= FIRST_ORDINARY_TOKEN:
        raise ValueError(f"vocab_size must exceed {FIRST_ORDINARY_TOKEN}, got {vocab_size}")
    rng = random.Random(spec.seed)
    system = _random_tokens(rng, spec.system_tokens, vocab_size)
    requests = []
    for index in range(spec.requests):
        document = _random_tokens(rng, spec.document_tokens, vocab_size)
        question = _random_tokens(rng, rng.randint(*spec.question_tokens), vocab_size)
        requests.append(Request(f"user{index + 1}", system + document + question))
    return requests


def warmup_request(length: int, vocab_size: int, salt: str) -> Request:
    """A throw-away prompt as long as the longest real one, different per ``salt`` (one per pass).

    The first long prefill of a fresh engine pays one-time costs (allocations, kernel set-up) that would
    otherwise land on the first measured request; a different salt per pass keeps it out of every cache.
    """
    rng = random.Random(f"warmup:{salt}")
    return Request("warmup", _random_tokens(rng, length, vocab_size))
