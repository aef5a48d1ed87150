"""``scripts/device_check.py``'s verdict on the bench it ran (the script itself needs a GPU; its verdict does not)."""

from __future__ import annotations

import runpy
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "device_check.py"
FULL = {"store_to_host_GBps": 48.8, "gpu_store_x_device_copy": 0.55, "load_from_host_device_checksum_cost": 0.17}


@pytest.fixture(scope="module")
def script() -> dict:
    return runpy.run_path(str(SCRIPT))


@pytest.fixture(scope="module")
def bench_problems(script):
    return script["bench_problems"]


def test_a_complete_bench_has_no_problem(bench_problems) -> None:
    assert bench_problems({"llama8b": FULL, "gemma3": FULL}, "cuda") == []


def test_each_missing_part_is_named_with_its_layout(bench_problems) -> None:
    host_hashed = {**FULL, "load_from_host_device_checksum_cost": None}
    no_graph = {**FULL, "gpu_store_x_device_copy": None}
    nothing_moved = {**FULL, "store_to_host_GBps": 0.0}
    failed = {"exit_code": 1, "error": "Traceback ...\nRuntimeError: no kernel image"}
    assert bench_problems({"a": host_hashed, "b": no_graph, "c": nothing_moved, "d": failed}, "cuda") == [
        "a: the device did not hash the chunks (the host did)",
        "b: no GPU time alone (CUDA graph replay)",
        "c: no store to pinned host memory was timed",
        "d: bench failed: Traceback ...\nRuntimeError: no kernel image"]


def test_xpu_has_no_graph_replay_to_miss(bench_problems) -> None:
    assert bench_problems({"llama8b": {**FULL, "gpu_store_x_device_copy": None}}, "xpu") == []


def test_each_figure_ranges_over_the_runs_that_have_it(script) -> None:
    runs = [{"exit_code": 1, "error": "killed"},
            {"backend": "triton", "chunks": 8, "store_to_host_GBps": 48.8, "load_from_host_device_checksum_cost": 0.17,
             "store_checksummed_x_memcpy": None, "batched": True},
            {"backend": "triton", "chunks": 8, "store_to_host_GBps": 49.6, "load_from_host_device_checksum_cost": 0.19,
             "store_checksummed_x_memcpy": None, "batched": True}]
    assert script["ranges"](runs) == {"chunks": [8, 8], "store_to_host_GBps": [48.8, 49.6],
                                      "load_from_host_device_checksum_cost": [0.17, 0.19]}
    assert script["ranges"]([]) == {}
