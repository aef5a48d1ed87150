"""Where vLLM keeps a recurrent-state (Mamba / GDN) group's state, so a chunk can carry it.

In ``mamba_cache_mode="align"`` vLLM writes the running state after a step into the block holding the step's
last token, and nulls the blocks a step skips over: the state after ``p`` tokens (``p`` a block boundary) lives
in block ``p / block - 1`` only if a step ended at ``p`` (or the step wrote an internal prefill checkpoint
there), and vLLM frees it a step or two later. vLLM's scheduler ends every prefill step but a request's last on
a block boundary and stops at the prompt's last boundary, whatever ``max_num_batched_tokens`` is. So a chunk's
state part is saved in the step that ends at the chunk's end, read before vLLM can free the block
(``state_ends``), and a hit ends only where a state part was saved. The chunk size must be a multiple of the
block: ``chunk_size_for`` picks the block when it is not.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any


def is_recurrent(spec: Any) -> bool:
    """A group whose layers keep a recurrent state (vLLM's ``MambaSpec`` and its subclasses)."""
    return any(klass.__name__ == "MambaSpec" for klass in type(spec).__mro__)


def snapshot_problem(spec: Any, chunk_size: int) -> str | None:
    """Why this recurrent group's state cannot travel in LMCache chunks (None when it can)."""
    mode = getattr(spec, "mamba_cache_mode", "none")
    block = spec.block_size
    if mode != "align":
        return (f"recurrent state is kept per block only with mamba_cache_mode='align' (it is {mode!r}): "
                "start vLLM with enable_prefix_caching=True, mamba_cache_mode='align'")
    if getattr(spec, "num_speculative_blocks", 0):
        return (f"speculative decoding ({spec.num_speculative_blocks} speculative state blocks) moves the running "
                "state between blocks: turn speculative decoding off")
    if chunk_size <= 0 or chunk_size % block:
        return (f"LMCache chunk_size {chunk_size} is not a multiple of vLLM's block size {block} tokens: "
                f"set chunk_size to a multiple of {block}")
    return None


def chunk_size_for(chunk_size: int, block_sizes: Sequence[int]) -> tuple[int, str]:
    """The chunk size to use with recurrent groups of these block sizes, and the start-up line saying why.

    A state exists only at block boundaries where a step ended; a chunk of one block has its end at every such
    boundary, a chunk of k blocks at one in k of them. A chunk size that is no multiple of the block would never
    carry a state, so the block (their least common multiple) replaces it."""
    block = math.lcm(*block_sizes)
    if chunk_size > 0 and chunk_size % block == 0:
        if chunk_size == block:
            return chunk_size, (f"recurrent state groups: chunk_size {chunk_size} equals vLLM's block; a chunk "
                                "carries the state wherever a vLLM step ends at its end")
        return chunk_size, (f"recurrent state groups: chunk_size {chunk_size} is {chunk_size // block} blocks of "
                            f"{block} tokens; a state is saved only where a vLLM step ends on a chunk boundary "
                            f"(chunk_size {block} saves one at every step end)")
    return block, (f"recurrent state groups: LMCache chunk_size {chunk_size} is not a multiple of vLLM's block "
                   f"of {block} tokens, where the states are kept; using chunk_size {block}")


def state_ends(snapshot_tables: Sequence[Sequence[int]], block_tokens: Sequence[int], start: int, end: int,
               chunk_size: int) -> tuple[int, ...]:
    """Chunk ends in ``(start, end]`` whose state this step wrote in every snapshot group: a chunk end ``c``
    whose block ``c / block - 1`` is a real block (vLLM nulls those a step skips over). Blocks before ``start``
    hold states of earlier steps, which those steps saved; vLLM may have freed them since."""
    first = start // chunk_size + 1
    return tuple(
        c for c in range(first * chunk_size, end + 1, chunk_size)
        if all(c // tokens - 1 < len(ids) and ids[c // tokens - 1] != 0
               for ids, tokens in zip(snapshot_tables, block_tokens, strict=True))
    )
