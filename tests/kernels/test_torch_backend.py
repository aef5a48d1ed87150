"""The reference backend against the byte-address oracle of PlaneGeometry, element by element."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels.contract import Direction
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.strategies import allocations, clone_planes, random_buffer, transfer_cases


def expected_pairs(planes, slots):
    """(buffer byte index, plane, absolute storage byte index) for every byte a transfer must move."""
    rows = slots.shape[-1]
    prefix = 0
    for index, plane in enumerate(planes):
        g = plane.geometry
        plane_slots = (slots[index] if slots.dim() == 2 else slots).tolist()
        for row, slot in enumerate(plane_slots):
            if slot >= 0:
                for segment in range(g.segments):
                    for byte in range(g.segment_bytes):
                        at = prefix * rows + row * g.row_bytes + segment * g.segment_bytes + byte
                        yield at, plane, plane.offset + g.byte_address(slot, segment, byte)
        prefix += g.row_bytes


@settings(max_examples=60, deadline=None)
@given(case=transfer_cases(), seed=st.integers(0, 1000))
def test_store_reads_exactly_the_addressed_bytes(case, seed):
    planes, slots = case
    before = random_buffer(planes, slots.shape[-1], seed)
    buffer = before.clone()
    TORCH.transfer(planes, slots, buffer, Direction.STORE)
    expected = before.clone()
    for at, plane, address in expected_pairs(planes, slots):
        expected[at] = plane.storage[address]
    assert torch.equal(buffer, expected)


@settings(max_examples=60, deadline=None)
@given(case=transfer_cases(), seed=st.integers(0, 1000))
def test_load_writes_exactly_the_addressed_bytes(case, seed):
    planes, slots = case
    buffer = random_buffer(planes, slots.shape[-1], seed)
    expected = clone_planes(planes)
    for at, plane, address in expected_pairs(expected, slots):
        plane.storage[address] = buffer[at]
    TORCH.transfer(planes, slots, buffer, Direction.LOAD)
    for got, want in zip(allocations(planes), allocations(expected), strict=True):
        assert torch.equal(got, want)


def test_buffer_of_any_dtype_is_moved_as_bytes():
    storage = torch.arange(64, dtype=torch.uint8)
    plane = Plane("l", "p", 0, torch.uint8, PlaneGeometry(4, 16, 2, 8, 1, 8, 8), 0, storage)
    buffer = torch.zeros(2, 4, dtype=torch.bfloat16)
    TORCH.transfer([plane], torch.tensor([3, -1]), buffer, Direction.STORE)
    assert buffer.view(torch.uint8).reshape(-1)[:8].tolist() == list(range(24, 32))
    assert buffer.view(torch.uint8).reshape(-1)[8:].tolist() == [0] * 8
