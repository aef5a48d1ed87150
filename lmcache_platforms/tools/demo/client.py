"""A streaming OpenAI client, as users drive vLLM's server: TTFT as the client sees it, tokens, top-k logits and
where each request's prefix came from (LMCache or vLLM's own prefix cache).

Requests go one at a time, so each TTFT is one request's own and the server's hit counters (``/metrics``) can be
attributed to the request between two reads. Clients sending to one server at once (``bench --servers
--concurrency``) leave the counters alone (``count_hits=False``) and take the server's own count per request.
Tokens come back as ids (``return_tokens_as_token_ids``: text pieces would make the identity check inexact);
with ``vllm serve --logprobs-mode raw_logits`` the top-k values are the model's bf16 logits, so a difference
can be counted in bf16 steps.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any

from lmcache_platforms.tools.demo.server import http_get

HIT_COUNTERS = {"lmcache": "vllm:external_prefix_cache_hits_total", "vllm": "vllm:prefix_cache_hits_total"}
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{[^}]*\})?\s+(?P<value>\S+)$")
_TOKEN_ID = re.compile(r"^token_id:(-?\d+)$")


def hit_counters(base_url: str) -> dict[str, int]:
    """Totals so far of prefix-cache hit tokens, from the server's Prometheus metrics (read without hurry: on a
    busy 2-core machine a fresh server's first /metrics answer once took over 5 s)."""
    totals = dict.fromkeys(HIT_COUNTERS, 0)
    for line in http_get(f"{base_url}/metrics", timeout_s=60.0).splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        for source, name in HIT_COUNTERS.items():
            if match["name"] == name:
                totals[source] += int(float(match["value"]))
    return totals


def token_id(piece: str) -> int:
    """A token as the server returns it with ``--return-tokens-as-token-ids`` (``token_id:123``)."""
    match = _TOKEN_ID.match(piece)
    if match is None:
        raise ValueError(f"expected a token as 'token_id:N', got {piece!r}")
    return int(match[1])


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    top_logprobs: int = 5


def served_model(client: Any) -> str:
    """The one model the server serves."""
    return client.models.list().data[0].id


def choice_tokens(choice: Any) -> tuple[list[int], list[list[list[float]]]] | None:
    """A streamed choice's token ids and, per token, its top-k (token id, raw logit) pairs ranked high to low
    (ties by id); None when the choice carries no token. A null logit (NaN or infinite) raises ValueError."""
    logprobs = choice.logprobs
    if logprobs is None or not logprobs.tokens:
        return None
    tokens = [token_id(piece) for piece in logprobs.tokens]
    top_logits = []
    for step in logprobs.top_logprobs or []:
        if any(v is None for v in step.values()):
            raise ValueError(f"the server sent a null logit ({step}): the model computed NaN or an infinity, which "
                             f"JSON cannot carry")
        ranked = sorted(((token_id(p), float(v)) for p, v in step.items()), key=lambda tv: (-tv[1], tv[0]))
        top_logits.append([[t, v] for t, v in ranked])
    return tokens, top_logits


def stream_completion(client: Any, model: str, name: str, prompt: str, prompt_tokens: int, sampling: Sampling,
                      base_url: str, extra_body: dict[str, Any] | None = None,
                      count_hits: bool = True) -> dict[str, Any]:
    """Send one prompt (with vLLM's ``extra_body`` fields, e.g. ``cache_salt``), stream the answer; the
    per-request result the demo and the tests compare. ``count_hits``: split the hit tokens between LMCache and
    vLLM's own cache from the server's counters, which is right only while no other request runs (else None);
    ``cached_tokens`` is the server's own count of both for this request, where it reports one
    (``--enable-prompt-tokens-details``)."""
    before = hit_counters(base_url) if count_hits else None
    started = time.perf_counter()
    first_token_s: float | None = None
    tokens: list[int] = []
    top_logits: list[list[list[float]]] = []
    usage = None
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=sampling.max_tokens, temperature=0.0, seed=0,
        logprobs=sampling.top_logprobs, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **(extra_body or {})},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            try:
                got = choice_tokens(choice)
            except ValueError as exc:
                raise AssertionError(f"{name}: after {len(tokens)} answer tokens {tokens}: {exc}") from exc
            if got is None:
                continue
            if first_token_s is None:
                first_token_s = time.perf_counter() - started
            tokens += got[0]
            top_logits += got[1]
    latency = time.perf_counter() - started
    after = hit_counters(base_url) if count_hits else None
    if usage is not None and usage.prompt_tokens != prompt_tokens:
        raise AssertionError(f"{name}: the server counted {usage.prompt_tokens} prompt tokens, the workload "
                             f"{prompt_tokens}: the tokenizer does not map one word to one token")
    return {
        "name": name,
        "prompt_tokens": prompt_tokens,
        "lmcache_hit_tokens": after["lmcache"] - before["lmcache"] if after and before else None,
        "vllm_hit_tokens": after["vllm"] - before["vllm"] if after and before else None,
        "cached_tokens": getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None),
        "ttft_s": first_token_s,
        "latency_s": latency,
        "tokens": tokens,
        "top_logits": top_logits,
    }


def run_requests(base_url: str, requests: list[tuple[str, str, int]], sampling: Sampling,
                 headers: dict[str, str] | None = None, extra_body: dict[str, Any] | None = None,
                 count_hits: bool = True) -> list[dict[str, Any]]:
    """``requests`` as (name, prompt text, prompt token count), one after another, over one connection sending
    ``headers`` (e.g. vLLM's ``X-data-parallel-rank``, which picks the data-parallel engine) and ``extra_body``;
    ``count_hits`` as for ``stream_completion``."""
    from openai import OpenAI

    with OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=600.0,
                default_headers=headers) as client:
        model = served_model(client)
        return [stream_completion(client, model, name, prompt, count, sampling, base_url, extra_body, count_hits)
                for name, prompt, count in requests]
