"""Faults planted into a fuzz pass's own process (negative controls of the oracle; never in the product).

- ``skip-row``: every 32nd row of every chunk of every group, from its first, and its last row are neither stored
  nor loaded (slot -1): the block keeps whatever it held before the load, right by chance where its previous owner
  had the same prefix. (The first row alone moved the slice's first-token logits by 2-3 bf16 units, at the
  oracle's tolerance: caught on one machine, missed on another.)
- ``window-off-by-one``: a sliding-window group's part of a chunk ends one row short (its last row, which every
  query after the chunk reads, is neither stored nor loaded).
- ``stale-after-preemption``: once vLLM preempts a request, the worker goes on writing into the blocks it held
  at every later step (as a load still in flight would), after vLLM handed them to other requests.
- ``pins-kept``: the worker no longer unpins what a finished request's lookup pinned (the leak the fuzzer found:
  a request looked up, then aborted by its client while it waited for blocks, kept its chunks pinned).

Plants join with ``+`` (``stale-after-preemption+pins-kept``): faults the oracle tells apart by their symptoms.
"""

from __future__ import annotations

from typing import Any


def _skip_rows() -> None:
    from lmcache_platforms.layout import kv_layout

    original = kv_layout.chunks_slots

    def chunks_slots(*args: Any, **kwargs: Any) -> Any:
        slots = original(*args, **kwargs).clone()
        slots[..., ::32] = -1
        slots[..., -1] = -1
        return slots

    kv_layout.chunks_slots = chunks_slots


def _window_off_by_one() -> None:
    from lmcache_platforms.layout import group_kinds

    original = group_kinds.SlidingWindow.rows

    def rows(self: Any, group: Any, start: int, end: int) -> tuple[int, int]:
        first, count = original(self, group, start, end)
        return (first, count - 1) if count > 1 else (first, count)

    group_kinds.SlidingWindow.rows = rows  # type: ignore[method-assign]


def _stale_after_preemption() -> None:
    import zlib

    from vllm.v1.core.sched.scheduler import Scheduler

    from lmcache_platforms.connector.poison import poison_blocks
    from lmcache_platforms.integration.vllm.worker_loads import WorkerLoads

    held: list[tuple[str, tuple[list[int], ...]]] = []
    preempt, start = Scheduler._preempt_request, WorkerLoads.start_load_kv

    def preempt_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        held.append((request.request_id, self.kv_cache_manager.get_block_ids(request.request_id)))
        return preempt(self, request, *args, **kwargs)

    def start_load_kv(self: Any, *args: Any, **kwargs: Any) -> Any:
        binding = self._binding()
        for req_id, blocks in held if binding is not None else ():
            poison_blocks(binding.layout, blocks, seed=zlib.crc32(req_id.encode()))
        return start(self, *args, **kwargs)

    Scheduler._preempt_request = preempt_request  # type: ignore[method-assign]
    WorkerLoads.start_load_kv = start_load_kv  # type: ignore[method-assign]


def _pins_kept() -> None:
    from lmcache_platforms.integration.vllm.worker_loads import WorkerLoads

    def release_finished(self: Any, finished_req_ids: set[str]) -> None:
        return None

    WorkerLoads.release_finished = release_finished  # type: ignore[method-assign]


# name -> (whether it goes in once the engine is up, the fault): importing vLLM's scheduler before the engine
# starts changes the order vLLM's CPU platform finds its kernels in, so that plant waits for the engine.
PLANTS = {"skip-row": (False, _skip_rows), "window-off-by-one": (False, _window_off_by_one),
          "stale-after-preemption": (True, _stale_after_preemption), "pins-kept": (True, _pins_kept)}


def install(name: str | None, engine_up: bool) -> None:
    """Plant each fault ``name`` joins that goes in at this point (before the engine starts, or once it is up)."""
    for part in name.split("+") if name else ():
        if PLANTS[part][0] == engine_up:
            PLANTS[part][1]()
