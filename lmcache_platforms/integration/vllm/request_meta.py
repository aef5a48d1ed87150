"""What the scheduler tells the workers about one request for one step: tokens, every group's blocks, and
whether to load and/or save. No slots travel: our GPU connector computes each chunk's slots from the blocks.

The saving rule is upstream's (save once a chunk boundary is crossed, never partial chunks mid-prefill, not
in decode unless asked) with three hybrid-model rules on top: with more than one saved group only whole chunks
are saved; a chunk is never saved while a row it must carry lies in vLLM's null block (a sliding-window
group's prefix that vLLM freed or never had, e.g. after a local prefix-cache hit) -- that chunk would come
back with rows missing; and a snapshot group's row of a chunk is saved only when this step wrote the state at
the chunk's end (``state_ends``), which the chunk's other parts do not wait for.

A snapshot group (recurrent state in vLLM's align mode) is loaded into a different block than the one it was
saved from: vLLM resumes a request with N computed tokens from the block holding the step's last token
(index ``(tokens after the step - 1) // block tokens``), after having copied into it the state of block
``N // block tokens - 1`` -- which, for tokens vLLM did not compute itself, is its null block. So a load writes
the snapshot at the hit point straight into that block, after vLLM's copy and before the forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache_platforms.integration.vllm.groups import GroupPlan
from lmcache_platforms.integration.vllm.recurrent import state_ends
from lmcache_platforms.integration.vllm.tracker import RequestTracker
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.slots import chunk_rows


@dataclass
class LoadSpec:
    """Tokens vLLM already holds, tokens LMCache holds, and whether the scheduler let us load."""

    vllm_cached_tokens: int
    lmcache_cached_tokens: int
    can_load: bool = False


@dataclass
class SaveSpec:
    """Leading tokens LMCache already has (not stored again), and whether to save this step."""

    skip_leading_tokens: int
    can_save: bool
    num_tokens: int = 0


@dataclass
class RequestMeta:
    """One request's step: its tokens, every group's block table (by group index) and what to load and save."""

    req_id: str
    token_ids: list[int]
    block_ids: tuple[tuple[int, ...], ...]
    save_spec: SaveSpec | None = None
    load_spec: LoadSpec | None = None
    request_configs: dict | None = None
    block_sizes: dict[int, tuple[int, int]] = field(default_factory=dict)
    snapshots: tuple[int, ...] = ()
    step_tokens: int = 0
    # Chunk ends saved this step whose snapshot groups' state this step wrote (``recurrent.state_ends``): only
    # those chunks' state parts are stored.
    state_ends: tuple[int, ...] = ()
    # Its load runs while vLLM holds the request in WAITING_FOR_REMOTE_KVS; reported per request.
    load_while_waiting: bool = False

    def blocks_not_held(self, vllm_cached_tokens: int, hit_tokens: int = 0) -> tuple[tuple[int, ...], ...]:
        """Block ids for a load of ``hit_tokens``: blocks wholly inside vLLM's own prefix hit become 0 (never
        written), since other requests may be reading those shared prefix-cache blocks; a snapshot group's
        table is all 0 but for the hit point's snapshot, redirected to the block vLLM resumes from."""
        out = []
        for index, ids in enumerate(self.block_ids):
            if index in self.snapshots:
                out.append(self._snapshot_load_ids(index, ids, hit_tokens))
                continue
            rows_per_block, tokens_per_row = self.block_sizes.get(index, (0, 1))
            held = vllm_cached_tokens // (rows_per_block * tokens_per_row) if rows_per_block else 0
            out.append((0,) * min(held, len(ids)) + ids[held:])
        return tuple(out)

    def _snapshot_load_ids(self, index: int, ids: tuple[int, ...], hit_tokens: int) -> tuple[int, ...]:
        block_tokens = self.block_sizes[index][1]
        hit_row, resume_row = hit_tokens // block_tokens - 1, (self.step_tokens - 1) // block_tokens
        if (hit_tokens % block_tokens or hit_row < 0 or resume_row >= len(ids) or hit_row >= len(ids)
                or ids[resume_row] == 0):
            raise ValueError(f"request {self.req_id}: group {index} has no snapshot block for a hit of {hit_tokens} "
                             f"tokens resumed at step end {self.step_tokens} ({len(ids)} blocks of {block_tokens} "
                             "tokens)")
        out = [0] * len(ids)
        out[hit_row] = ids[resume_row]
        return tuple(out)

    def failed_blocks(self, start: int, end: int) -> set[int]:
        """Every saved group's (non-null) blocks holding tokens ``[start, end)``, each with its own block size."""
        failed: set[int] = set()
        if end <= start:
            return failed
        for index, (rows_per_block, tokens_per_row) in self.block_sizes.items():
            ids = self.block_ids[index]
            first = start // tokens_per_row // rows_per_block
            last = (end - 1) // tokens_per_row // rows_per_block
            failed.update(b for b in ids[first : last + 1] if b != 0)
        return failed


def first_savable_token(groups: Sequence[KVGroup], block_ids: Sequence[Sequence[int]], start: int, end: int,
                        chunk_size: int) -> int:
    """The first chunk boundary at or after ``start`` from which every chunk up to ``end`` has all its rows
    in real blocks; ``end`` when none does. ``start`` and ``end`` are chunk-aligned (or ``end`` is the
    request's last, partial chunk end)."""
    savable_from = start
    for c0 in range(start, end, chunk_size):
        c1 = min(c0 + chunk_size, end)
        for group in groups:
            first, count = chunk_rows(group, c0, c1, chunk_size)
            ids = block_ids[group.index]
            blocks = {ids[r // group.block_size] if r // group.block_size < len(ids) else 0
                      for r in range(first, first + count)}
            if 0 in blocks:
                savable_from = c1
                break
    return savable_from


def _token_ids_for_keys(tracker: RequestTracker, num_tokens: int) -> list[int]:
    token_ids = tracker.token_ids[:num_tokens]
    if not tracker.mm_hashes:
        return token_ids
    from lmcache.integration.vllm.utils import apply_mm_hashes_to_token_ids

    tensor = torch.tensor(token_ids)
    apply_mm_hashes_to_token_ids(tensor, tracker.mm_hashes, tracker.mm_positions)
    return tensor.tolist()


def build_request_meta(
    tracker: RequestTracker,
    plan: GroupPlan,
    chunk_size: int,
    load_spec: LoadSpec | None = None,
    discard_partial_chunks: bool = True,
    save_decode_cache: bool = False,
    force_skip_save: bool = False,
) -> RequestMeta | None:
    """The step's metadata for one request, or None when it neither loads nor saves (updates the tracker's
    saved-token count when it saves)."""
    num_tokens = len(tracker.token_ids)
    is_last_prefill = num_tokens >= tracker.prompt_len
    skip_leading = tracker.num_saved_tokens
    boundary = -(-(tracker.num_saved_tokens + 1) // chunk_size) * chunk_size
    skip_save = (
        force_skip_save
        or tracker.skip_save
        or (tracker.num_saved_tokens > 0 and num_tokens < boundary)
        or (tracker.is_decode_phase and not save_decode_cache)
        or bool((tracker.request_configs or {}).get("lmcache.skip_save", False))
        or not plan.hits_allowed
    )
    if skip_save and load_spec is None:
        return None
    whole_chunks_only = plan.whole_chunks_only or not is_last_prefill or discard_partial_chunks
    num_to_save = num_tokens // chunk_size * chunk_size if whole_chunks_only else num_tokens
    groups = plan.saved_groups
    block_ids = tuple(tuple(ids) for ids in tracker.block_ids)
    ends: tuple[int, ...] = ()
    if not skip_save:
        aligned = skip_leading // chunk_size * chunk_size
        rows = [g for g in groups if not g.kind.snapshots]  # a snapshot row exists only at a state end
        savable = first_savable_token(rows, block_ids, aligned, num_to_save, chunk_size)
        skip_leading = max(skip_leading, savable)
        tracker.num_saved_tokens = num_to_save
        ends = _state_ends(tracker, plan, block_ids, chunk_size, skip_leading, num_to_save)
    can_save = not skip_save and skip_leading < num_to_save
    if not can_save and load_spec is None:
        return None
    load_len = load_spec.lmcache_cached_tokens if load_spec is not None else 0
    token_ids = _token_ids_for_keys(tracker, max(num_to_save, min(load_len, num_tokens)))
    return RequestMeta(
        req_id=tracker.req_id,
        token_ids=token_ids,
        block_ids=block_ids,
        save_spec=SaveSpec(skip_leading, can_save, num_to_save),
        load_spec=load_spec,
        request_configs=tracker.request_configs,
        block_sizes={g.index: (g.block_size, g.tokens_per_row) for g in groups},
        snapshots=plan.snapshot_groups,
        step_tokens=num_tokens,
        state_ends=ends,
    )


def _state_ends(tracker: RequestTracker, plan: GroupPlan, block_ids: tuple[tuple[int, ...], ...], chunk_size: int,
                first: int, last: int) -> tuple[int, ...]:
    """The ends of the chunks saved this step (``(first, last]``) that carry their state."""
    if not plan.snapshot_groups:
        return ()
    snapshot = [plan.groups[i] for i in plan.snapshot_groups]
    ends = state_ends([block_ids[g.index] for g in snapshot], [g.tokens_per_row for g in snapshot],
                      tracker.step_start, len(tracker.token_ids), chunk_size)
    return tuple(c for c in ends if first < c <= last)
