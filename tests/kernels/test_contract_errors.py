"""The contract's refusals, word for word: what a user reads when a layout or a call is wrong names the plane,
the layer and the value."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache_platforms.kernels.contract import TransferError, validate_transfer
from lmcache_platforms.kernels.plane_table import check_bounds, plane_device
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.checks import small_group


def _refusal(call, *args) -> str:
    with pytest.raises(TransferError) as raised:
        call(*args)
    return str(raised.value)


def test_a_transfer_without_planes():
    assert _refusal(validate_transfer, [], torch.tensor([0]), torch.zeros(0, dtype=torch.uint8)) == (
        "a transfer group needs at least one plane")


def test_a_plane_without_a_tensor():
    planes = small_group()
    bare = dataclasses.replace(planes[1], storage=None)
    assert _refusal(validate_transfer, [planes[0], bare], torch.tensor([0, 1]), torch.zeros(32, dtype=torch.uint8)) == (
        "plane 'v' of layer 'l0' has no tensor behind it")
    assert _refusal(check_bounds, bare) == "plane 'v' of layer 'l0' has no tensor behind it"


def test_slots_of_three_dimensions_and_a_strided_buffer():
    planes = small_group()
    assert _refusal(validate_transfer, planes, torch.zeros((2, 1, 2), dtype=torch.int64),
                    torch.zeros(32, dtype=torch.uint8)) == "slots must be [R] or [P, R], got shape (2, 1, 2)"
    assert _refusal(validate_transfer, planes, torch.tensor([0, 1]), torch.zeros(64, dtype=torch.uint8)[::2]) == (
        "the chunk buffer must be contiguous")


def test_planes_on_two_devices():
    host = small_group()[0]
    meta = dataclasses.replace(host, name="m", storage=torch.empty(128, dtype=torch.uint8, device="meta"))
    assert plane_device([host, host]) == torch.device("cpu")
    assert _refusal(plane_device, [host, meta]) == (
        "the planes of one transfer must share one device, got ['cpu', 'meta']")


@pytest.mark.parametrize("field", ["rows_per_block", "segments", "segment_bytes", "block_stride", "row_stride",
                                   "segment_stride", "num_blocks"])
def test_each_invalid_geometry_value_alone_is_refused(field):
    """One bad value at a time, the others valid: each is checked on its own."""
    plane = small_group()[0]
    bad = -1 if field in ("block_stride", "row_stride", "segment_stride", "num_blocks") else 0
    geometry = dataclasses.replace(plane.geometry, **{field: bad})
    wrong = dataclasses.replace(plane, geometry=geometry)
    assert _refusal(check_bounds, wrong) == f"plane 'k' of layer 'l0' has an invalid geometry {geometry}"


def test_a_negative_offset_is_refused():
    plane = dataclasses.replace(small_group()[0], offset=-8)
    assert _refusal(check_bounds, plane) == f"plane 'k' of layer 'l0' has an invalid geometry {plane.geometry}"


def test_a_valid_plane_passes():
    plane = Plane("l0", "k", 0, torch.uint8, PlaneGeometry(4, 16, 2, 8, 1, 8, 8), 0,
                  torch.zeros(64, dtype=torch.uint8))
    check_bounds(plane)
