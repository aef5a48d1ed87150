"""The native CPU backend: bit-exact against `torch` on random byte layouts, refusals, missing library."""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels import cpu_backend, native_library
from lmcache_platforms.kernels.contract import Direction, TransferError, buffer_bytes
from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.checks import (
    assert_load_matches_torch,
    assert_store_matches_torch,
    check_refusals,
    parallel_group,
    small_group,
)
from tests.kernels.strategies import clone_planes, interleaved_cases, transfer_cases

pytestmark = pytest.mark.skipif(not CPU.availability()[0], reason=CPU.availability()[1])


@settings(max_examples=60, deadline=None)
@given(case=transfer_cases(), seed=st.integers(0, 1000))
def test_store_matches_torch(case, seed):
    assert_store_matches_torch(CPU, *case, seed)


@settings(max_examples=60, deadline=None)
@given(case=transfer_cases(), seed=st.integers(0, 1000))
def test_load_matches_torch(case, seed):
    assert_load_matches_torch(CPU, *case, seed)


@settings(max_examples=60, deadline=None)
@given(case=interleaved_cases(), seed=st.integers(0, 1000))
def test_interleaved_rows_match_torch_both_ways(case, seed):
    """K stored transposed goes through 8 x 8 tiles (SSE2 for 2-byte elements) and element-wise leftovers."""
    assert_store_matches_torch(CPU, *case, seed)
    assert_load_matches_torch(CPU, *case, seed)


@settings(max_examples=25, deadline=None)
@given(page=st.integers(8 * 1024 - 3, 48 * 1024), offset=st.integers(0, 63), planes=st.integers(1, 3),
       data=st.data())
def test_block_pages_stream_both_ways(page, offset, planes, data):
    """Block rows (whole pages) go through non-temporal stores (loads from 8 KiB, stores from 32 KiB, so both
    sides of each threshold): destinations at every alignment, a tail shorter than one 64-byte step, runs of
    adjacent pages, holes."""
    blocks = 6
    storage = torch.randint(0, 256, (planes * blocks * page + offset + 64,), dtype=torch.uint8)
    geometry = PlaneGeometry(blocks, page, 1, 0, 1, page, 0)
    group = [Plane(f"l{i}", "page", 0, torch.uint8, geometry, offset + i * blocks * page, storage)
             for i in range(planes)]
    slots = torch.tensor(data.draw(st.lists(st.sampled_from([-1, 0, 1, 2, 3, 4, 5]), min_size=1, max_size=6,
                                            unique=True)), dtype=torch.int64)
    seed = data.draw(st.integers(0, 1000))
    assert_store_matches_torch(CPU, group, slots, seed)
    assert_load_matches_torch(CPU, group, slots, seed)


def test_parallel_path_on_a_big_group():
    """Over the parallel threshold: 16 planes of 64 blocks x 16 rows x 512 bytes, runs and holes (distinct)."""
    planes, slots = parallel_group()
    assert buffer_bytes(planes, slots.numel()) > 256 * 1024
    assert_store_matches_torch(CPU, planes, slots, 1)
    assert_load_matches_torch(CPU, planes, slots, 2)


def test_refusals():
    check_refusals(CPU)


def test_rejects_device_buffers_it_cannot_reach():
    planes = small_group()
    meta = torch.empty(32, dtype=torch.uint8, device="meta")
    with pytest.raises(TransferError, match="cpu backend needs host tensors"):
        CPU.transfer(planes, torch.tensor([0, 1]), meta, Direction.STORE)


def test_missing_library_makes_the_backend_unavailable_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(native_library, "LIBRARY_MODULE", "lmcache_platforms.kernels._not_built")
    native_library.load_library.cache_clear()
    logger = logging.getLogger("lmcache_platforms")
    logger.addHandler(caplog.handler)
    try:
        backend = cpu_backend.CpuBackend()
        available, reason = backend.availability()
        assert not available
        assert "lmcache_platforms.kernels._not_built was not built" in reason
        for _ in range(2):
            with pytest.raises(TransferError, match="the cpu backend is unavailable"):
                backend.transfer(small_group(), torch.tensor([0]), torch.zeros(16, dtype=torch.uint8),
                                 Direction.STORE)
        warnings = [r for r in caplog.records if "native CPU transfer kernels unavailable" in r.getMessage()]
        assert len(warnings) == 1
    finally:
        logger.removeHandler(caplog.handler)
        native_library.load_library.cache_clear()


def big_group(seed: int) -> tuple[list[Plane], torch.Tensor]:
    """8 planes of 32 blocks x 16 rows x 1 KiB (4 MiB per chunk of 512 rows): the parallel path."""
    gen = torch.Generator().manual_seed(seed)
    storage = torch.randint(0, 256, (8 * 32 * 16 * 1024,), dtype=torch.uint8, generator=gen)
    geometry = PlaneGeometry(32, 16 * 1024, 16, 1024, 1, 1024, 1024)
    planes = [Plane(f"l{i}", "kv", 0, torch.uint8, geometry, i * 32 * 16 * 1024, storage) for i in range(8)]
    return planes, torch.randperm(32 * 16, generator=gen)


def test_concurrent_store_and_load_from_two_threads():
    """A store and a load running at once (async save while loading) each get exactly their own bytes."""
    store_planes, store_slots = big_group(1)
    load_planes, load_slots = big_group(2)
    expected_store = torch.empty(buffer_bytes(store_planes, 512), dtype=torch.uint8)
    CPU.transfer(store_planes, store_slots, expected_store, Direction.STORE)
    source = torch.randint(0, 256, (buffer_bytes(load_planes, 512),), dtype=torch.uint8)
    reference = clone_planes(load_planes)
    TORCH.transfer(reference, load_slots, source, Direction.LOAD)
    errors: list[BaseException] = []

    def repeat(work) -> None:
        try:
            for _ in range(20):
                work()
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    stored = torch.empty_like(expected_store)
    threads = [
        threading.Thread(target=repeat, args=(lambda: CPU.transfer(store_planes, store_slots, stored,
                                                                   Direction.STORE),)),
        threading.Thread(target=repeat, args=(lambda: CPU.transfer(load_planes, load_slots, source,
                                                                   Direction.LOAD),)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert torch.equal(stored, expected_store)
    assert torch.equal(load_planes[0].storage, reference[0].storage)


def _store_in_child(queue) -> None:
    """Only our kernel runs threads here: torch's own OpenMP pool is not usable in a forked child."""
    planes, slots = big_group(3)
    buffer = torch.empty(buffer_bytes(planes, 512), dtype=torch.uint8)
    CPU.transfer(planes, slots, buffer, Direction.STORE)
    queue.put(hashlib.sha256(buffer.numpy()).hexdigest())


def test_a_forked_child_transfers_with_a_fresh_pool():
    """The helper threads do not survive fork; the child must neither hang nor skip rows."""
    planes, slots = big_group(3)
    buffer = torch.empty(buffer_bytes(planes, 512), dtype=torch.uint8)
    CPU.transfer(planes, slots, buffer, Direction.STORE)  # starts the parent's helpers
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_store_in_child, args=(queue,))
    child.start()
    child.join(timeout=60)
    assert child.exitcode == 0
    assert queue.get(timeout=5) == hashlib.sha256(buffer.numpy()).hexdigest()
