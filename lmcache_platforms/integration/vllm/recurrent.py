"""When vLLM keeps a recurrent-state (Mamba / GDN) group's state at every LMCache chunk boundary.

In ``mamba_cache_mode="align"`` vLLM writes the running state into the block holding a scheduled step's
last token, so a block's state exists only where a step ended; the scheduler ends prefill steps on block
boundaries, at most ``max_num_batched_tokens`` apart. A chunk can carry the state at its end only if a step
ended there, which holds for every chunk when no step spans more than one block and chunks are whole blocks.
Each rule below names the setting to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class StepSettings:
    """The LMCache chunk size and vLLM's per-step token budget (0 where unknown)."""

    chunk_size: int = 0
    max_num_batched_tokens: int = 0

    @classmethod
    def from_vllm(cls, vllm_config: Any, chunk_size: int) -> StepSettings:
        scheduler = getattr(vllm_config, "scheduler_config", None)
        return cls(chunk_size, int(getattr(scheduler, "max_num_batched_tokens", 0) or 0))


def is_recurrent(spec: Any) -> bool:
    """A group whose layers keep a recurrent state (vLLM's ``MambaSpec`` and its subclasses)."""
    return any(klass.__name__ == "MambaSpec" for klass in type(spec).__mro__)


def snapshot_problem(spec: Any, steps: StepSettings) -> str | None:
    """Why this recurrent group's state is not kept at every chunk boundary (None when it is)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    block = spec.block_size
    if mode != "align":
        return (f"recurrent state is kept per block only with mamba_cache_mode='align' (it is {mode!r}): "
                "start vLLM with enable_prefix_caching=True, mamba_cache_mode='align'")
    if getattr(spec, "num_speculative_blocks", 0):
        return (f"speculative decoding ({spec.num_speculative_blocks} speculative state blocks) moves the running "
                "state between blocks: turn speculative decoding off")
    if steps.chunk_size <= 0 or steps.chunk_size % block:
        return (f"LMCache chunk_size {steps.chunk_size} is not a multiple of vLLM's block size {block} tokens: "
                f"set chunk_size to a multiple of {block}")
    if not 0 < steps.max_num_batched_tokens < 2 * block:
        return (f"max_num_batched_tokens {steps.max_num_batched_tokens} lets one prefill step span several "
                f"{block}-token blocks, and vLLM keeps the state only where a step ends: set "
                f"max_num_batched_tokens below {2 * block} (e.g. {block})")
    return None
