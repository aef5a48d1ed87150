"""The scheduler's lookup rules: which tokens a lookup asks for, and what vLLM allocates of the hit (exact cases,
and properties over every hit, vLLM prefix and request length)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lmcache_platforms.integration.vllm.lookup_span import HitSpan, LookupRules, hit_span

CHUNK = 256


def test_the_tokens_looked_up() -> None:
    tokens = list(range(1000))
    assert LookupRules(CHUNK).tokens(tokens, 1000) == tokens
    assert LookupRules(CHUNK, skip_last_n_tokens=10).tokens(tokens, 1000) == tokens[:990]
    # Snapshot groups: up to the last chunk boundary before the last token (768 of 1000; 512 of 769 and of 768).
    assert len(LookupRules(CHUNK, stop_before_last_chunk_end=True).tokens(tokens, 1000)) == 768
    assert len(LookupRules(CHUNK, stop_before_last_chunk_end=True).tokens(tokens[:769], 769)) == 768
    assert len(LookupRules(CHUNK, stop_before_last_chunk_end=True).tokens(tokens[:768], 768)) == 512
    assert LookupRules(CHUNK, skip_last_n_tokens=5).tokens(tokens[:3], 3) == []


def test_what_vllm_allocates_of_a_hit() -> None:
    rules = LookupRules(CHUNK)
    assert hit_span(rules, 512, 0, 600) == HitSpan(512, 512)
    assert hit_span(rules, 512, 128, 600) == HitSpan(384, 512)  # vLLM's own prefix is not loaded again
    assert hit_span(rules, 512, 512, 600) == HitSpan(0, 512)
    assert hit_span(rules, 512, 0, 512) == HitSpan(511, 512)  # the last token is computed by vLLM
    assert hit_span(rules, 0, 0, 600) == HitSpan(0, 0)
    assert hit_span(LookupRules(CHUNK, min_retrieve_tokens=300), 512, 256, 600) == HitSpan(0, 512)
    # At most 300 tokens past vLLM's 128: the load ends at chunk boundary 256.
    assert hit_span(LookupRules(CHUNK, max_tokens_per_load=300), 1024, 128, 1100) == HitSpan(128, 256)
    assert hit_span(LookupRules(CHUNK, max_tokens_per_load=100), 1024, 0, 1100) == HitSpan(0, 0)


@given(hit_chunks=st.integers(0, 16), computed=st.integers(0, 4200), extra=st.integers(0, 300),
       min_retrieve=st.sampled_from([0, 1, 200, 700]), max_load=st.sampled_from([0, 100, 256, 1000, 5000]))
def test_the_span_is_what_vllm_accepts(hit_chunks: int, computed: int, extra: int, min_retrieve: int,
                                       max_load: int) -> None:
    """vLLM allocates exactly the load's tokens past its own (one fewer when the load ends the request), never
    more than the cap, never a negative count; the load never ends past the hit."""
    hit = hit_chunks * CHUNK
    num_tokens = max(hit, computed) + extra
    if num_tokens == 0:
        return
    rules = LookupRules(CHUNK, min_retrieve_tokens=min_retrieve, max_tokens_per_load=max_load)
    span = hit_span(rules, hit, computed, num_tokens)
    assert span.allocate >= 0 and span.load_end <= hit
    if span.allocate:
        assert span.allocate == span.load_end - computed - (span.load_end == num_tokens)
        assert span.allocate >= min_retrieve and (max_load == 0 or span.allocate <= max_load)
    elif min_retrieve == 0 and max_load == 0:
        assert hit - computed - (hit == num_tokens) <= 0
