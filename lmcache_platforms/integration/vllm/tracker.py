"""Scheduler-side memory of one request: its tokens so far and EVERY group's block ids.

Upstream's tracker keeps ``block_ids[0]`` only, which is why hybrid models could not be offloaded. vLLM sends
block ids as one list per group: a new request's full table, then per step the blocks to append (running)
or a whole new table (resumed after preemption). Block id 0 is the null block and is kept in place: it
marks rows that have no storage (out-of-window prefix of a sliding-window group).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def block_ids_per_group(value: Any, num_groups: int) -> list[list[int]]:
    """vLLM's block ids in any generation's shape as one list per group.

    ``None`` or ``()`` means "no new blocks"; a flat ``list[int]`` is the pre-0.9 single-group form.
    """
    if value is None or len(value) == 0:
        return [[] for _ in range(num_groups)]
    if not isinstance(value[0], (list, tuple)):
        if num_groups != 1:
            raise ValueError(f"got a flat block id list for a model with {num_groups} KV-cache groups")
        return [[int(b) for b in value]]
    if len(value) != num_groups:
        raise ValueError(f"got block ids for {len(value)} KV-cache groups, the model has {num_groups}")
    return [[int(b) for b in ids] for ids in value]


@dataclass
class RequestTracker:
    """Tokens scheduled so far, every group's blocks, and how much of the request LMCache already holds."""

    req_id: str
    prompt_len: int
    token_ids: list[int]
    block_ids: list[list[int]]
    num_saved_tokens: int = 0
    skip_save: bool = False
    is_decode_phase: bool = False
    request_configs: dict[str, Any] | None = None
    mm_hashes: list[str] | None = None
    mm_positions: list[Any] | None = None
    step_start: int = 0
    """Tokens computed before the step being scheduled (a recurrent state is written only within a step)."""

    @classmethod
    def from_new_request(
        cls,
        new_request: Any,
        num_groups: int,
        num_tokens_to_compute: int,
        lmcache_cached_tokens: int,
        skip_save: bool,
        request_configs: dict[str, Any] | None = None,
    ) -> RequestTracker:
        """From vLLM's ``NewRequestData``; ``num_tokens_to_compute`` counts vLLM's local hit too."""
        prompt = list(new_request.prompt_token_ids or [])
        return cls(
            req_id=new_request.req_id,
            prompt_len=len(prompt),
            token_ids=prompt[:num_tokens_to_compute],
            block_ids=block_ids_per_group(new_request.block_ids, num_groups),
            num_saved_tokens=lmcache_cached_tokens,
            skip_save=skip_save,
            request_configs=request_configs,
            step_start=int(new_request.num_computed_tokens),
        )

    @property
    def num_groups(self) -> int:
        return len(self.block_ids)

    def append(self, new_token_ids: Sequence[int], new_block_ids: Any) -> None:
        """A running request was scheduled again: its new tokens and new blocks follow the old ones."""
        for ids, new in zip(self.block_ids, block_ids_per_group(new_block_ids, self.num_groups), strict=True):
            ids.extend(new)
        self.step_start = len(self.token_ids)
        self.token_ids.extend(new_token_ids)
        self.is_decode_phase = self._decoding(len(new_token_ids))

    def resume(
        self,
        all_token_ids: Sequence[int],
        new_block_ids: Any,
        num_computed_tokens: int,
        num_new_tokens: int,
        lmcache_cached_tokens: int,
    ) -> None:
        """A preempted request came back: vLLM gave it a whole new block table and recomputes from
        ``num_computed_tokens`` (its local hit or LMCache's, whichever is longer)."""
        self.block_ids = block_ids_per_group(new_block_ids, self.num_groups)
        self.num_saved_tokens = lmcache_cached_tokens
        needed = max(num_computed_tokens + num_new_tokens, lmcache_cached_tokens)
        self.token_ids = list(all_token_ids[:needed])
        self.step_start = num_computed_tokens
        self.is_decode_phase = self._decoding(num_new_tokens)

    def _decoding(self, num_new_tokens: int) -> bool:
        """A step of one token past the prompt is decoding; one token of the prompt (what a scheduler's budget
        left) is still prefill, whose chunks must be saved (upstream's sticky "one token => decoding" flag
        stopped saving the rest of such a prompt)."""
        return num_new_tokens == 1 and len(self.token_ids) > self.prompt_len

    def roll_back(self, num_tokens: int, all_token_ids: Sequence[int]) -> None:
        """vLLM reset the request to ``num_tokens`` computed tokens (a failed load): forget the rest."""
        self.token_ids = list(all_token_ids[:num_tokens])
        self.num_saved_tokens = min(self.num_saved_tokens, num_tokens)
