"""The Triton backend under TRITON_INTERPRET=1 on CPU tensors (small cases: the interpreter is slow)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels import triton_backend
from lmcache_platforms.kernels.contract import Direction
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.checks import (
    assert_chunks_match_torch,
    assert_load_matches_torch,
    assert_store_matches_torch,
    check_chunk_refusals,
    check_refusals,
    interpreter,
)
from tests.kernels.strategies import chunk_cases, storage_of, transfer_cases

pytest.importorskip("triton")


@settings(max_examples=25, deadline=None)
@given(case=transfer_cases(max_planes=3, max_rows=6), seed=st.integers(0, 1000))
def test_store_and_load_match_torch(case, seed):
    with interpreter() as backend:
        assert_store_matches_torch(backend, *case, seed)
        assert_load_matches_torch(backend, *case, seed)


@pytest.mark.parametrize("unit", [1, 2, 4, 8])
def test_wide_units_and_multi_piece_rows(unit):
    """Rows wider than one program's block, K and V segments interleaved, moved in every unit width."""
    storage = storage_of(torch.randint(0, 256, (3 * 192 * unit,), dtype=torch.uint8))
    geometry = PlaneGeometry(3, 192 * unit, 4, 48 * unit, 8, 3 * unit, 6 * unit)
    planes = [Plane("l", "k", 0, torch.uint8, geometry, 0, storage),
              Plane("l", "v", 0, torch.uint8, geometry, 3 * unit, storage)]
    slots = torch.tensor([5, 6, -1, 0, 11], dtype=torch.int64)
    with interpreter() as backend:
        backend.block = 8
        assert triton_backend.transfer_unit(planes, 0) == unit
        assert_store_matches_torch(backend, planes, slots, unit)
        assert_load_matches_torch(backend, planes, slots, unit)


@settings(max_examples=25, deadline=None)
@given(case=chunk_cases(max_planes=3, max_rows=6), seed=st.integers(0, 1000))
def test_a_batch_of_chunks_in_one_launch_matches_torch_chunk_by_chunk(case, seed):
    with interpreter() as backend:
        assert_chunks_match_torch(backend, *case, seed)


def test_refusals():
    with interpreter() as backend:
        check_refusals(backend)
        check_chunk_refusals(backend)


def test_availability_without_interpreter_or_gpu(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    backend = triton_backend.TritonBackend()
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    available, reason = backend.availability()
    assert not available
    assert reason == "no CUDA or XPU device (set TRITON_INTERPRET=1 to run on CPU)"
    planes = [Plane("l", "k", 0, torch.uint8, PlaneGeometry(1, 8, 1, 8, 1, 8, 8), 0, torch.zeros(8, dtype=torch.uint8))]
    assert backend.unsupported(planes) == "planes on ['cpu'], triton here moves ['cuda', 'xpu'] memory"


def test_one_launch_moves_the_whole_group():
    """The kernel object is called once per transfer, whatever the plane count."""
    storage = storage_of(torch.randint(0, 256, (6 * 64,), dtype=torch.uint8))
    geometry = PlaneGeometry(4, 16, 2, 8, 1, 8, 8)
    planes = [Plane(f"l{i}", "kv", 0, torch.uint8, geometry, i * 64, storage) for i in range(6)]
    with interpreter() as backend:
        kernel, _ = triton_backend._kernel()
        calls = []
        original = kernel.run

        def counting_run(*args, **kwargs):
            calls.append(kwargs.get("grid"))
            return original(*args, **kwargs)

        kernel.run = counting_run
        try:
            buffer = torch.zeros(6 * 3 * 8, dtype=torch.uint8)
            backend.transfer(planes, torch.tensor([1, 2, 7]), buffer, Direction.STORE)
        finally:
            kernel.run = original
        assert len(calls) == 1
