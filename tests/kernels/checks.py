"""Contract checks shared by every backend's tests: same bytes as `torch`, and refusals before any write."""

from __future__ import annotations

import contextlib
import dataclasses
import os

import pytest
import torch

from lmcache_platforms.kernels import triton_backend
from lmcache_platforms.kernels.contract import Direction, KernelBackend, TransferError, buffer_bytes
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.strategies import allocations, clone_planes, random_buffer, storage_of


def assert_store_matches_torch(backend: KernelBackend, planes, slots, seed: int) -> None:
    """Store with ``backend`` and with ``torch`` into equal random buffers; the buffers must match exactly."""
    rows = slots.shape[-1]
    before = random_buffer(planes, rows, seed).to(slots.device)
    got, want = before.clone(), before.clone()
    snapshot = [a.clone() for a in allocations(planes)]
    backend.transfer(planes, slots, got, Direction.STORE)
    TORCH.transfer(planes, slots, want, Direction.STORE)
    assert torch.equal(got, want)
    for plane_bytes, original in zip(allocations(planes), snapshot, strict=True):
        assert torch.equal(plane_bytes, original), "a store wrote into a plane"


def assert_load_matches_torch(backend: KernelBackend, planes, slots, seed: int) -> None:
    """Load one random buffer with ``backend`` and with ``torch`` into equal planes; every byte must match."""
    buffer = random_buffer(planes, slots.shape[-1], seed).to(slots.device)
    kept = buffer.clone()
    reference = clone_planes(planes)
    backend.transfer(planes, slots, buffer, Direction.LOAD)
    TORCH.transfer(reference, slots, buffer, Direction.LOAD)
    for got, want in zip(allocations(planes), allocations(reference), strict=True):
        assert torch.equal(got, want)
    assert torch.equal(buffer, kept), "a load wrote into the buffer"


def assert_chunks_match_torch(backend: KernelBackend, planes, slots, gap: int, seed: int) -> None:
    """``transfer_chunks`` over N chunks ``gap`` bytes apart against ``torch`` moving each chunk alone: the same
    bytes both ways, nothing written between the chunks by a store, nothing into the buffer by a load."""
    count, rows = slots.shape[0], slots.shape[-1]
    per_chunk = buffer_bytes(planes, rows)
    stride = per_chunk + gap
    size = max(0, (count - 1) * stride + per_chunk) + gap
    gen = torch.Generator().manual_seed(seed)
    before = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).to(slots.device)
    snapshot = [a.clone() for a in allocations(planes)]
    got, want = before.clone(), before.clone()
    backend.transfer_chunks(planes, slots, got, stride, Direction.STORE)
    for index in range(count):
        TORCH.transfer(planes, slots[index], want[index * stride : index * stride + per_chunk], Direction.STORE)
    assert torch.equal(got, want)
    for plane_bytes, original in zip(allocations(planes), snapshot, strict=True):
        assert torch.equal(plane_bytes, original), "a store wrote into a plane"
    reference = clone_planes(planes)
    kept = before.clone()
    backend.transfer_chunks(planes, slots, before, stride, Direction.LOAD)
    for index in range(count):
        TORCH.transfer(reference, slots[index], before[index * stride : index * stride + per_chunk], Direction.LOAD)
    for got_plane, want_plane in zip(allocations(planes), allocations(reference), strict=True):
        assert torch.equal(got_plane, want_plane)
    assert torch.equal(before, kept), "a load wrote into the buffer"


def check_chunk_refusals(backend: KernelBackend) -> None:
    """Bad batches raise TransferError naming the problem, and no chunk is written: the bad slot is in the
    last chunk, so a backend moving chunk by chunk before checking them all would have written the first."""
    planes = small_group()
    per_chunk = buffer_bytes(planes, 2)
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    cases = [
        (torch.tensor([[0, 1], [2, 8]]), per_chunk, 2 * per_chunk, r"slot 8 is beyond plane 'k' of layer 'l0'"),
        (torch.tensor([[[0, 1], [2, 3]], [[4, 5], [6, 9]]]), per_chunk, 2 * per_chunk, "slot 9 is beyond plane 'v'"),
        (good, per_chunk - 1, 2 * per_chunk, "chunks 31 bytes apart overlap: each holds 32 bytes"),
        (good, per_chunk, 2 * per_chunk - 1,
         "the chunks' buffer holds 63 bytes, 2 chunks of 32 bytes 32 bytes apart need 64"),
        (good.to(torch.int32), per_chunk, 2 * per_chunk, "slots must be int64"),
        (good[0], per_chunk, 2 * per_chunk, r"batched slots must be \[N, R\] or \[N, P, R\], got shape \(2,\)"),
        (torch.zeros((2, 3, 2), dtype=torch.int64), per_chunk, 2 * per_chunk, "slots has 3 rows for 2 planes"),
    ]
    for slots, stride, size, message in cases:
        for direction in Direction:
            buffer = torch.full((size,), 0xAB, dtype=torch.uint8)
            before = planes[0].storage.clone()
            with pytest.raises(TransferError, match=message):
                backend.transfer_chunks(planes, slots, buffer, stride, direction)
            assert torch.equal(planes[0].storage, before)
            assert bool((buffer == 0xAB).all())
    for direction in Direction:
        with pytest.raises(TransferError, match="the chunks' buffer must be a contiguous 1-D uint8 tensor"):
            backend.transfer_chunks(planes, good, torch.zeros(2 * per_chunk // 4, dtype=torch.int32), per_chunk,
                                    direction)


def small_group() -> list[Plane]:
    """Two planes of 4 blocks x 2 rows x 8 bytes over one allocation."""
    storage = storage_of(torch.arange(128, dtype=torch.uint8))
    geometry = PlaneGeometry(4, 16, 2, 8, 1, 8, 8)
    return [Plane("l0", "k", 0, torch.uint8, geometry, 0, storage),
            Plane("l0", "v", 0, torch.uint8, geometry, 64, storage)]


def parallel_group() -> tuple[list[Plane], torch.Tensor]:
    """Over the native pool's parallel threshold (2.3 MiB moved): 16 planes of 64 blocks x 16 rows x 512 bytes,
    and slots with runs and holes (distinct)."""
    storage = torch.randint(0, 256, (16 * 64 * 16 * 512,), dtype=torch.uint8)
    geometry = PlaneGeometry(64, 16 * 512, 16, 512, 1, 512, 512)
    planes = [Plane(f"l{i}", "kv", 0, torch.uint8, geometry, i * 64 * 16 * 512, storage) for i in range(16)]
    slots = torch.cat([torch.arange(160, 400), torch.tensor([-1, 5, 3, -1]), (torch.randperm(34)[:20] + 30) * 16])
    return planes, slots


def check_refusals(backend: KernelBackend) -> None:
    """Bad calls raise TransferError naming the problem, and nothing is written in either direction."""
    planes = small_group()
    good = torch.tensor([0, 7], dtype=torch.int64)
    cases = [
        (torch.tensor([0, 8]), buffer_bytes(planes, 2), r"slot 8 is beyond plane 'k' of layer 'l0' \(8 slots"),
        (torch.tensor([[0, 1], [2, 9]]), buffer_bytes(planes, 2), "slot 9 is beyond plane 'v'"),
        (good, buffer_bytes(planes, 2) - 1, "chunk buffer holds 31 bytes, 2 rows of these planes need 32"),
        (good.to(torch.int32), buffer_bytes(planes, 2), "slots must be int64"),
        (torch.tensor([[0, 1]]), buffer_bytes(planes, 2), "slots has 1 rows for 2 planes"),
        (torch.tensor([[0, 1], [2, 8]]), buffer_bytes(planes, 2), "slot 8 is beyond plane 'v'"),
        (torch.zeros((2, 1, 2), dtype=torch.int64), buffer_bytes(planes, 2),
         r"slots must be \[R\] or \[P, R\], got shape \(2, 1, 2\)"),
    ]
    for slots, size, message in cases:
        for direction in Direction:
            buffer = torch.full((size,), 0xAB, dtype=torch.uint8)
            before = planes[0].storage.clone()
            with pytest.raises(TransferError, match=message):
                backend.transfer(planes, slots, buffer, direction)
            assert torch.equal(planes[0].storage, before)
            assert bool((buffer == 0xAB).all())
    strided = torch.full((2 * buffer_bytes(planes, 2),), 0xAB, dtype=torch.uint8)[::2]
    for direction in Direction:
        with pytest.raises(TransferError, match="the chunk buffer must be contiguous"):
            backend.transfer(planes, good, strided, direction)
        assert bool((strided == 0xAB).all())
    too_long = dataclasses.replace(planes[1], geometry=dataclasses.replace(planes[1].geometry, num_blocks=5))
    for direction in Direction:
        with pytest.raises(TransferError, match="plane 'v' of layer 'l0' reaches byte 144 of an allocation of 128"):
            backend.transfer([planes[0], too_long], good, torch.zeros(32, dtype=torch.uint8), direction)


@contextlib.contextmanager
def interpreter():
    """Runs the block with Triton's interpreter on, compiling the kernel afresh on both sides."""
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    triton_backend._kernel.cache_clear()
    try:
        yield triton_backend.TritonBackend()
    finally:
        if previous is None:
            os.environ.pop("TRITON_INTERPRET")
        else:
            os.environ["TRITON_INTERPRET"] = previous
        triton_backend._kernel.cache_clear()
