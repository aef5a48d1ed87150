"""A fix (declared in the patch catalog) for the device LMCache 0.5.6 gives a worker of a data-parallel rank other
than 0.

LMCache finds a worker's local device as vLLM's CUDA worker does: its rank, plus the local data-parallel rank
times the engine's world size, mapped through the platform's logical-to-visible device table. That holds
where every data-parallel engine sees all of the node's devices (CUDA and XPU under vLLM's own process
launcher). On every other platform (CPU, and by vLLM 0.32's launcher code out-of-tree ones such as Ascend's,
not run here) and under Ray, vLLM 0.32 gives each data-parallel engine its own table,
``assigned_physical_gpu_ids``, whose logical ids start at 0, and its workers add no offset. Upstream's offset
then indexes past that table: the worker of rank 1 raised ``IndexError`` while LMCache started, and LMCache ran
it in degraded mode (every request recomputed, nothing stored) while rank 0 worked -- half a data-parallel
server without LMCache. With such a table the worker's index is its rank within the engine, as vLLM's own
workers take it.
"""

from __future__ import annotations

from typing import Any


def wrap_local_device_index(upstream: Any) -> Any:
    """Patch-catalog wrapper of LMCache's ``_vllm_local_device_index(parallel_config)``."""

    def local_device_index(parallel_config: Any) -> int:
        if getattr(parallel_config, "assigned_physical_gpu_ids", None) is None:
            return upstream(parallel_config)
        from vllm.platforms import current_platform

        return current_platform.logical_device_id_to_visible_device_id(parallel_config.rank)

    return local_device_index
