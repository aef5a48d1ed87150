"""The plane-table cache every native and Triton launch goes through: the same table for the same planes, a new
one for a new allocation or device, least recently used evicted, the identity path free of per-plane work, and
the quick validation agreeing with ``validate_transfer`` without calling it on well-formed calls."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lmcache_platforms.kernels import plane_table
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.kernels.plane_table import ON_PLANES, TableCache, build_table
from lmcache_platforms.layout.plane import Plane, buffer_bytes
from tests.kernels.checks import small_group


def _group(fill: int = 0) -> tuple[Plane, ...]:
    """``small_group`` over a fresh allocation of its own."""
    planes = small_group()
    storage = torch.full((128,), fill, dtype=torch.uint8)
    return tuple(dataclasses.replace(p, storage=storage) for p in planes)


def test_the_same_planes_get_the_same_table_built_from_them():
    cache, planes = TableCache(), _group()
    entry = cache.entry(planes)
    assert cache.entry(planes) is entry
    assert cache.entry(list(planes)) is entry  # equal planes over the same allocation, looked up by value
    assert torch.equal(entry.table, build_table(planes)) and entry.table.device.type == "cpu"
    assert entry.row_bytes == buffer_bytes(planes, 1) == 16
    assert entry.widest_row == 8 and entry.address_unit == 8
    assert entry.capacities.tolist() == [8, 8] and entry.min_capacity == 8
    assert torch.equal(cache.get(planes), entry.table)


def test_the_table_rows_are_each_planes_address_geometry_and_buffer_prefix():
    planes = _group()
    base = planes[0].allocation_address()
    expected = [[base, 16, 2, 8, 1, 8, 8, 8, 0], [base + 64, 16, 2, 8, 1, 8, 8, 8, 8]]
    assert plane_table.FIELDS == ("base", "block_stride", "rows_per_block", "row_stride", "segments",
                                  "segment_bytes", "segment_stride", "row_bytes", "buffer_prefix")
    table = build_table(planes)
    assert table.dtype == torch.int64 and table.tolist() == expected


def test_a_list_of_planes_is_found_by_value():
    cache, planes = TableCache(), _group()
    first = cache.entry(list(planes))
    assert cache.entry(list(planes)) is first


def test_a_new_allocation_with_the_same_description_gets_its_own_table():
    cache = TableCache()
    old, new = _group(), _group()
    assert old == new  # planes compare by description
    assert cache.entry(old) is not cache.entry(new)
    assert cache.entry(new).table[0, 0] == new[0].allocation_address() != old[0].allocation_address()


def test_each_device_gets_its_own_table():
    cache, planes = TableCache(), _group()
    on_host = cache.entry(planes)
    on_meta = cache.entry(planes, "meta")
    own = cache.entry(planes, ON_PLANES)
    assert on_meta is not on_host and on_meta.table.device.type == "meta"
    assert own is not on_host and own.table.device.type == "cpu" and torch.equal(own.table, on_host.table)
    assert cache.entry(planes) is on_host
    assert cache.get(planes, "meta").device.type == "meta"


def test_a_tuple_seen_before_is_found_without_touching_its_planes(monkeypatch):
    """The launch hot path: a transfer group passes the same tuple every time; 60 planes walked per launch cost
    more than the launch (measured on an H200)."""
    cache, planes = TableCache(), _group()
    entry = cache.entry(planes, ON_PLANES)

    def walked(*_args):
        raise AssertionError("a plane was read on the identity path")

    monkeypatch.setattr(Plane, "allocation_address", walked)
    monkeypatch.setattr(plane_table, "plane_device", walked)
    assert cache.entry(planes, ON_PLANES) is entry


def test_the_least_recently_used_table_is_evicted_at_capacity():
    cache = TableCache(capacity=2)
    a, b, c = _group(), _group(), _group()
    first_a, first_b = cache.entry(list(a)), cache.entry(list(b))
    assert cache.entry(list(a)) is first_a  # a is now the most recent
    cache.entry(list(c))
    assert cache.entry(list(a)) is first_a
    assert cache.entry(list(b)) is not first_b  # evicted, built again


def test_the_default_capacity_is_64_plane_groups():
    cache = TableCache()
    groups = [_group() for _ in range(65)]
    first = cache.entry(list(groups[0]))
    kept = cache.entry(list(groups[1]))
    for group in groups[2:64]:
        cache.entry(list(group))
    assert cache.entry(list(groups[0])) is first  # 64 held, groups[1] now least recent
    cache.entry(list(groups[64]))
    assert cache.entry(list(groups[0])) is first
    assert cache.entry(list(groups[1])) is not kept


@pytest.mark.parametrize("slots", [
    torch.tensor([0, 7]), torch.tensor([[0, 7], [7, -1]]), torch.tensor([-1, -1]), torch.zeros(0, dtype=torch.int64),
], ids=["shared", "per-plane", "all-skipped", "no-rows"])
def test_well_formed_calls_pass_the_quick_check_alone(slots, monkeypatch):
    planes = _group()
    entry = TableCache().entry(planes)

    def full_check(*_args):
        raise AssertionError("the quick check handed a well-formed call to validate_transfer")

    monkeypatch.setattr(plane_table, "validate_transfer", full_check)
    entry.validate(planes, slots, torch.zeros(buffer_bytes(planes, slots.shape[-1]), dtype=torch.uint8))
    entry.validate(planes, slots, torch.zeros(buffer_bytes(planes, slots.shape[-1]) // 2, dtype=torch.int16))


@pytest.mark.parametrize(("slots", "buffer", "message"), [
    (torch.tensor([[0, 1], [2, 8]]), 32, "slot 8 is beyond plane 'v' of layer 'l0' (8 slots: 4 blocks x 2 rows)"),
    (torch.tensor([0, 8]), 32, "slot 8 is beyond plane 'k' of layer 'l0' (8 slots: 4 blocks x 2 rows)"),
    (torch.zeros((2, 1, 2), dtype=torch.int64), 32, "slots must be [R] or [P, R], got shape (2, 1, 2)"),
    (torch.tensor([[0, 1], [2, 3], [4, 5]]), 32, "slots has 3 rows for 2 planes"),
    (torch.tensor([0, 1]), 31, "chunk buffer holds 31 bytes, 2 rows of these planes need 32"),
    (torch.tensor([0, 1], dtype=torch.int32), 32, "slots must be int64, got torch.int32"),
], ids=["per-plane-capacity", "shared-capacity", "three-dims", "plane-count", "buffer-size", "dtype"])
def test_malformed_calls_get_validate_transfers_exact_error(slots, buffer, message):
    planes = _group()
    with pytest.raises(TransferError) as raised:
        TableCache().entry(planes).validate(planes, slots, torch.zeros(buffer, dtype=torch.uint8))
    assert str(raised.value) == message


def test_a_strided_buffer_is_refused():
    planes = _group()
    strided = torch.zeros(64, dtype=torch.uint8)[::2]
    with pytest.raises(TransferError) as raised:
        TableCache().entry(planes).validate(planes, torch.tensor([0, 1]), strided)
    assert str(raised.value) == "the chunk buffer must be contiguous"
