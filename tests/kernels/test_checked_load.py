"""The CPU backend's load that checks each stripe just before writing its rows: on an intact object the same
planes as a plain load; with one flipped byte no row ever holds it, and the load says so whenever a row it
writes would have; random layouts, stripe sizes, object offsets, threads, every CRC path."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels.contract import Direction, buffer_bytes
from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.kernels.crc32c import native
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.checks import parallel_group
from tests.kernels.crc_paths import PATHS, check_against, crc_path, stripes_of
from tests.kernels.strategies import clone_planes, interleaved_cases, transfer_cases

pytestmark = pytest.mark.skipif(native() is None or not CPU.availability()[0], reason="the native library is not built")


def _rows(planes) -> list[torch.Tensor]:
    return [p.rows_view().clone() for p in planes]


def check(planes, slots, stripe: int, before: int, after: int, flip: int | None, seed: int, backend=CPU) -> None:
    """Loads ``planes`` from an object of random bytes (the buffer at ``before``) through ``load_checked``, the
    byte at ``flip`` of the object changed after its stripes were taken."""
    nbytes = buffer_bytes(planes, slots.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    obj = torch.randint(0, 256, (before + nbytes + after,), dtype=torch.uint8, generator=gen)
    expected = stripes_of(obj, stripe)
    intact = clone_planes(planes)
    TORCH.transfer(intact, slots, obj[before : before + nbytes], Direction.LOAD)
    flip = flip % obj.numel() if flip is not None and obj.numel() else None
    if flip is not None:
        obj[flip] = obj[flip] ^ 0xFF if obj[flip] != 0xFF else 0x0F
    unchecked = clone_planes(planes)
    TORCH.transfer(unchecked, slots, obj[before : before + nbytes], Direction.LOAD)
    old = _rows(planes)
    loaded = backend.load_checked(planes, slots, obj[before : before + nbytes],
                                  check_against(obj, obj.numel(), stripe, expected), before)
    for now, was, good in zip(_rows(planes), old, _rows(intact), strict=True):
        assert bool(((now == was).all(dim=-1) | (now == good).all(dim=-1)).all()), "a row holds unchecked bytes"
    if flip is None or all(torch.equal(a, b) for a, b in zip(_rows(unchecked), _rows(intact), strict=True)):
        if loaded:
            assert all(torch.equal(a, b) for a, b in zip(_rows(planes), _rows(intact), strict=True))
        else:
            assert flip is not None, "an intact object failed its check"
    else:
        assert not loaded, "a row that held the flipped byte was loaded as intact"


@PATHS
@settings(max_examples=80, deadline=None)
@given(case=st.one_of(transfer_cases(), interleaved_cases()), stripe=st.integers(1, 3000),
       before=st.integers(0, 5000), after=st.integers(0, 3000), flip=st.none() | st.integers(0, 20000),
       seed=st.integers(0, 1000))
def test_random_layouts_write_only_checked_stripes(vectors, case, stripe, before, after, flip, seed):
    """Strided segments, transposed tiles, runs and skipped rows; stripes cut anywhere (inside a row too)."""
    with crc_path(vectors):
        check(*case, stripe, before, after, flip, seed)


@PATHS
@settings(max_examples=60, deadline=None)
@given(case=transfer_cases(), stripe=st.integers(1, 512), before=st.integers(0, 600), flip=st.integers(0, 2**20),
       seed=st.integers(0, 1000))
def test_a_flip_in_the_rows_is_caught_in_stripes_hashed_ahead(vectors, case, stripe, before, flip, seed):
    """The flipped byte always lies in the buffer and stripes are short, so most lie past the first one a
    thread checks: those are hashed ahead, inside the copies of the rows before them."""
    planes, slots = case
    nbytes = buffer_bytes(planes, slots.shape[-1])
    with crc_path(vectors):
        check(planes, slots, stripe, before, 0, before + flip % nbytes if nbytes else None, seed)


@PATHS
@settings(max_examples=20, deadline=None)
@given(flip=st.none() | st.integers(0, 3 * 1024 * 1024), stripe=st.sampled_from([4096, 65536, 100000]),
       seed=st.integers(0, 100))
def test_a_parallel_load_over_many_stripes(vectors, flip, stripe, seed):
    """Over the parallel threshold: several threads share stripes at their grabs' edges (one hashes, the others
    wait for its verdict); a mismatch stops them all."""
    planes, slots = parallel_group()
    assert buffer_bytes(planes, slots.numel()) > 2 * 1024 * 1024
    with crc_path(vectors):
        check(planes, slots, stripe, 300, 8, flip, seed)


def test_the_default_checks_every_stripe_first():
    """A backend without its own (here `torch`) checks every stripe its buffer overlaps, then loads: nothing is
    written when one fails."""
    storage = torch.randint(0, 256, (4 * 16 * 256,), dtype=torch.uint8)
    planes = [Plane("l0", "kv", 0, torch.uint8, PlaneGeometry(4, 16 * 256, 16, 256, 1, 256, 256), 0, storage)]
    slots = torch.arange(3, 40)
    check(planes, slots, 1000, 10, 0, None, 1, TORCH)
    old = _rows(planes)
    obj = torch.randint(0, 256, (buffer_bytes(planes, 37),), dtype=torch.uint8)
    expected = stripes_of(obj, 1000)
    obj[-1] ^= 1
    assert not TORCH.load_checked(planes, slots, obj, check_against(obj, obj.numel(), 1000, expected), 0)
    assert all(torch.equal(a, b) for a, b in zip(_rows(planes), old, strict=True))


def test_a_planted_fault_is_caught():
    """Negative control: the oracle sees a row that holds the flipped byte, so it would catch a load that
    wrote unchecked bytes (here a plain load)."""
    storage = torch.randint(0, 256, (4 * 16 * 256,), dtype=torch.uint8)
    planes = [Plane("l0", "kv", 0, torch.uint8, PlaneGeometry(4, 16 * 256, 16, 256, 1, 256, 256), 0, storage)]
    slots = torch.arange(0, 48)

    class Unchecked(type(TORCH)):
        def load_checked(self, planes, slots, buffer, check, offset):
            self.transfer(planes, slots, buffer, Direction.LOAD)
            return True

    with pytest.raises(AssertionError, match="a row holds unchecked bytes"):
        check(planes, slots, 5000, 0, 0, 7777, 2, Unchecked())
