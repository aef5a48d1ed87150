"""The device LMCache gives the worker of data-parallel rank 1 (two ranks of one worker each), computed by LMCache's
own ``calculate_local_rank_and_world_size`` over vLLM's real ``ParallelConfig``: with the per-rank device table
vLLM 0.32 hands a CPU or NPU engine it is that table's device, where upstream raised (and LMCache ran the rank in
degraded mode); without one (CUDA and XPU under vLLM's launcher) upstream's offset stays."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.upstream_originals import put_back


def _rank_one_config(assigned: list[int] | None) -> SimpleNamespace:
    from vllm.config import ParallelConfig

    parallel = ParallelConfig(data_parallel_size=2)
    parallel.data_parallel_rank = parallel.data_parallel_rank_local = 1
    parallel.assigned_physical_gpu_ids = assigned
    return SimpleNamespace(parallel_config=parallel)  # the one field the function reads


@pytest.fixture(autouse=True)
def activated() -> None:
    import lmcache_platforms

    lmcache_platforms.activate()


@pytest.fixture
def device_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1's table as vLLM's worker process publishes it: its one device is the node's device 1."""
    from vllm.platforms import interface

    monkeypatch.setattr(interface, "_assigned_physical_gpu_ids", [1])


def test_a_rank_with_its_own_device_table_gets_that_tables_device(device_table: None) -> None:
    from lmcache.integration.vllm.utils import calculate_local_rank_and_world_size

    assert calculate_local_rank_and_world_size(_rank_one_config([1])) == (1, 1)


def test_without_a_device_table_upstreams_offset_stays() -> None:
    from lmcache.integration.vllm.utils import calculate_local_rank_and_world_size

    assert calculate_local_rank_and_world_size(_rank_one_config(None)) == (1, 1)  # rank 0 + DP rank 1 x 1


def test_upstream_offsets_past_the_table(device_table: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: with LMCache's own function put back, rank 1's worker cannot start LMCache."""
    from lmcache.integration.vllm.utils import calculate_local_rank_and_world_size

    assert put_back(monkeypatch, lambda patch: patch.attr == "_vllm_local_device_index")
    with pytest.raises(IndexError, match=r"device_id 1 is out of range for assigned_physical_gpu_ids \[1\]"):
        calculate_local_rank_and_world_size(_rank_one_config([1]))
