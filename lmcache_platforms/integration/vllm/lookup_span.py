"""What a scheduler-side lookup asks LMCache for, and what of its answer vLLM is told to allocate.

The scheduler side looks up a request itself (``SchedulerSide.get_num_new_matched_tokens``) with the request's
scope and limit as arguments, so nothing reaches the lookup client through state set around an upstream call.
The rules are upstream's connector settings: tokens left off the end (``skip_last_n_tokens``), a smallest load
worth doing (``min_retrieve_tokens``), a largest load per step (``lmcache.max_tokens_per_load``), and ours: a
model with snapshot groups stops short of its last token (a hit must end where a state was kept).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LookupRules:
    """How one connector turns a request into a lookup, and a hit into a load."""

    chunk_size: int
    skip_last_n_tokens: int = 0
    min_retrieve_tokens: int = 0
    max_tokens_per_load: int = 0
    stop_before_last_chunk_end: bool = False

    def tokens(self, token_ids: Sequence[int], num_tokens: int) -> Sequence[int]:
        """The tokens to look up of a request of ``num_tokens`` tokens: without the last
        ``skip_last_n_tokens``; with snapshot groups, up to the last chunk boundary before its last token."""
        end = len(token_ids) - self.skip_last_n_tokens if self.skip_last_n_tokens > 0 else len(token_ids)
        if self.stop_before_last_chunk_end:
            end = min(end, (num_tokens - 1) // self.chunk_size * self.chunk_size)
        return token_ids[:max(end, 0)]


@dataclass(frozen=True)
class HitSpan:
    """A hit as vLLM takes it: tokens to allocate beyond vLLM's own, and where LMCache's load ends."""

    allocate: int
    load_end: int


def hit_span(rules: LookupRules, hit: int, num_computed: int, num_tokens: int) -> HitSpan:
    """What vLLM allocates of an LMCache hit of ``hit`` tokens when it holds ``num_computed`` of ``num_tokens``.

    vLLM computes a request's last token itself, so a hit of the whole request allocates one token less. A load
    longer than ``max_tokens_per_load`` ends at the last chunk boundary within that many tokens past vLLM's own;
    the rest is computed. A load shorter than ``min_retrieve_tokens`` (after that cut) allocates nothing, and the
    hit still ends where the request's stores start.
    """
    allocate, end = hit - num_computed - (1 if hit == num_tokens else 0), hit
    if 0 < rules.max_tokens_per_load < allocate:
        end = (num_computed + rules.max_tokens_per_load) // rules.chunk_size * rules.chunk_size
        allocate = end - num_computed
    if rules.min_retrieve_tokens > 0 and allocate < rules.min_retrieve_tokens:
        return HitSpan(0, hit)
    return HitSpan(max(allocate, 0), end)
