"""``bench --engine --checksum-cost``: each hashing store and checking load is paired with its plain twin, the
checksum's own calls are timed, and the cost per request is their difference over LMCache's figure."""

from __future__ import annotations

import pytest
import torch

from lmcache_platforms.connector import checksum
from lmcache_platforms.kernels.contract import Direction, buffer_bytes
from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.kernels.crc32c import native
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.tools import checksum_cost
from tests.kernels.checks import parallel_group
from tests.kernels.strategies import allocations, clone_planes

pytestmark = pytest.mark.skipif(native() is None or not CPU.availability()[0],
                                reason="needs the native CPU library (python setup.py build_ext --inplace)")


def totals(**seconds: float) -> dict:
    out = checksum_cost.Totals().as_dict()
    out.update(seconds)
    return out


def test_the_cost_is_the_kernels_difference_plus_the_checksums_own_calls_per_request() -> None:
    # Two loads LMCache timed at 10 and 14 ms, inside which the paired plain calls took 6 ms, the checked ones 8
    # and the checksum's own Python 1: the checksum cost 3 ms (1.5 a request) of the 24 - 6 - 3 = 15 without it.
    got = checksum_cost.cost(totals(load_calls=4, load_checksummed=0.008, load_plain=0.006, load_python=0.001),
                             "load", [0.010, 0.014])
    assert got == {"checksum_load_ms": pytest.approx(1.5), "checksum_load_python_ms": pytest.approx(0.5),
                   "checksum_load_share": pytest.approx(0.2)}
    # A checked kernel faster than its twin: the difference counts, negative.
    got = checksum_cost.cost(totals(store_calls=2, store_checksummed=0.004, store_plain=0.005, store_python=0.0005),
                             "store", [0.020])
    assert got == {"checksum_store_ms": pytest.approx(-0.5), "checksum_store_python_ms": pytest.approx(0.5),
                   "checksum_store_share": pytest.approx(-0.0005 / 0.0155)}


def test_a_pass_that_never_checked_a_host_object_has_no_figure() -> None:
    none = {"checksum_load_ms": None, "checksum_load_python_ms": None, "checksum_load_share": None}
    assert checksum_cost.cost(totals(), "load", [0.010]) == none
    assert checksum_cost.cost(totals(load_calls=2, load_checksummed=0.001), "load", []) == none


class Scripted:
    """The order of each pair, scripted: below 0.5 the plain twin goes first."""

    def __init__(self, draws: list[float]) -> None:
        self.draws = draws

    def random(self) -> float:
        return self.draws.pop(0)


def test_installed_each_call_runs_with_its_plain_twin_and_the_bytes_stay_exact(monkeypatch) -> None:
    monkeypatch.setattr(checksum_cost, "TOTALS", checksum_cost.Totals())
    # The store; two intact loads checked stripe by stripe, two corrupt ones: each order once; a hashed load.
    order = Scripted([0.9, 0.9, 0.1, 0.9, 0.1, 0.1])
    monkeypatch.setattr(checksum_cost, "_ORDER", order)
    checksum_cost.install(monkeypatch.setattr)
    planes, slots = parallel_group()
    payload = buffer_bytes(planes, slots.shape[-1])
    flat = torch.zeros(payload + checksum.tail_bytes(payload), dtype=torch.uint8)
    stripes, (hashed,) = checksum.stripe_room(payload, 1), checksum.object_stripes(payload)
    CPU.store_hashed(planes, slots, flat[:payload], hashed, 0)
    hashed.finish(stripes[0])
    checksum.seal([flat], payload, stripes)
    want = torch.zeros(payload, dtype=torch.uint8)
    TORCH.transfer(planes, slots, want, Direction.STORE)
    assert torch.equal(flat[:payload], want)
    assert checksum.mismatched([flat], payload) == []

    for storage in {id(a): a for a in allocations(planes)}.values():
        storage.zero_()
    reference = clone_planes(planes)
    TORCH.transfer(reference, slots, want, Direction.LOAD)
    for _ in range(2):  # the checked call first, then its plain twin first
        check = checksum.object_check(flat, payload)
        assert CPU.load_checked(planes, slots, flat[:payload], check, 0) and check.check(0, payload)
    for got, expected in zip(allocations(planes), allocations(reference), strict=True):
        assert torch.equal(got, expected)

    flat[7] ^= 1  # the checked call's verdict is what the pair returns, whichever ran first
    assert [CPU.load_checked(planes, slots, flat[:payload], checksum.object_check(flat, payload), 0)
            for _ in range(2)] == [False, False]
    flat[7] ^= 1
    for storage in {id(a): a for a in allocations(planes)}.values():
        storage.zero_()
    (loaded,) = checksum.object_stripes(payload)
    CPU.load_hashed(planes, slots, flat[:payload], loaded, 0)
    for got, expected in zip(allocations(planes), allocations(reference), strict=True):
        assert torch.equal(got, expected)
    assert order.draws == []
    seen = checksum_cost.TOTALS.as_dict()
    assert (seen["store_calls"], seen["load_calls"]) == (1, 5)
    assert all(seen[key] > 0 for key in ("store_checksummed", "store_plain", "store_python", "load_checksummed",
                                         "load_plain", "load_python")), seen


def test_without_install_nothing_is_paired_or_timed(monkeypatch) -> None:
    """The control: the same store and load leave fresh totals untouched when nothing was installed."""
    monkeypatch.setattr(checksum_cost, "TOTALS", checksum_cost.Totals())
    planes, slots = parallel_group()
    payload = buffer_bytes(planes, slots.shape[-1])
    flat = torch.zeros(payload + checksum.tail_bytes(payload), dtype=torch.uint8)
    (hashed,) = checksum.object_stripes(payload)
    CPU.store_hashed(planes, slots, flat[:payload], hashed, 0)
    assert checksum_cost.TOTALS.as_dict() == checksum_cost.Totals().as_dict()


def test_the_checksums_own_calls_count_for_the_direction_the_connector_moves(monkeypatch) -> None:
    """A load makes its stripe states with the store's functions: inside ``load_verified`` they are the load's
    cost; elsewhere, the direction they serve by default."""
    monkeypatch.setattr(checksum_cost, "TOTALS", checksum_cost.Totals())
    checksum_cost.install(monkeypatch.setattr)
    checksum_cost._moving("load", checksum.object_stripes)(1 << 20, 4)
    seen = checksum_cost.TOTALS.as_dict()
    assert seen["load_python"] > 0 and seen["store_python"] == 0
    checksum.object_stripes(1 << 20, 4)
    assert checksum_cost.TOTALS.as_dict()["store_python"] > 0
