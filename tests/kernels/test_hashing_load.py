"""The load that hashes as it copies (``KernelBackend.load_hashed``): the same rows as a plain load, and stripe
CRC-32Cs equal to hashing the object, on random layouts, stripe sizes, object offsets, threads and every CRC path.
Its verdict comes after the copy, so a corrupt byte is written and must be seen in the stripes."""

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
from tests.kernels.crc_paths import PATHS, crc_path, native_crc, stripes_of
from tests.kernels.strategies import interleaved_cases, transfer_cases

pytestmark = pytest.mark.skipif(native() is None or not CPU.availability()[0], reason="the native library is not built")


def hashed_load(planes, slots, obj: torch.Tensor, offset: int, stripe: int, backend=CPU) -> torch.Tensor:
    """Loads the planes from ``obj`` at ``offset`` with ``backend.load_hashed``, the bytes around them fed from
    memory, and returns the stripe CRCs the load built."""
    nbytes = buffer_bytes(planes, slots.shape[-1])
    stripes = native_crc().object_stripes(obj.numel(), stripe)
    stripes.feed(obj[:offset], 0)
    backend.load_hashed(planes, slots, obj[offset : offset + nbytes], stripes, offset)
    stripes.feed(obj[offset + nbytes :], offset + nbytes)
    out = torch.zeros_like(stripes.registers)
    stripes.finish(out)
    return out


def _storages(planes) -> list[torch.Tensor]:
    return list({id(p.storage): p.storage for p in planes}.values())


def check(planes, slots, stripe: int, before: int, after: int, seed: int, backend=CPU) -> None:
    nbytes = buffer_bytes(planes, slots.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    obj = torch.randint(0, 256, (before + nbytes + after,), dtype=torch.uint8, generator=gen)
    original = [s.clone() for s in _storages(planes)]
    TORCH.transfer(planes, slots, obj[before : before + nbytes], Direction.LOAD)
    expected = [s.clone() for s in _storages(planes)]
    for storage, saved in zip(_storages(planes), original, strict=True):
        storage.copy_(saved)
    got = hashed_load(planes, slots, obj, before, stripe, backend)
    for storage, want in zip(_storages(planes), expected, strict=True):
        assert torch.equal(storage, want), "the hashing load wrote other bytes than a plain load"
    assert torch.equal(got, stripes_of(obj, stripe))


@PATHS
@settings(max_examples=80, deadline=None)
@given(case=st.one_of(transfer_cases(), interleaved_cases()), stripe=st.integers(1, 3000),
       before=st.integers(0, 5000), after=st.integers(0, 3000), seed=st.integers(0, 1000))
def test_random_layouts_hash_as_they_load(vectors, case, stripe, before, after, seed):
    """Strided segments, transposed tiles, runs and skipped rows, cut by stripes anywhere (inside a row too)."""
    with crc_path(vectors):
        check(*case, stripe, before, after, seed)


@PATHS
@settings(max_examples=25, deadline=None)
@given(page=st.integers(8 * 1024 - 3, 48 * 1024), offset=st.integers(0, 63), stripe=st.integers(300, 70000),
       before=st.integers(0, 70000), data=st.data())
def test_block_pages_hash_inside_the_streaming_copy(vectors, page, offset, stripe, before, data):
    """Whole pages: runs from 8 KiB go through streaming stores into the KV cache, hashed in the same loop, at
    every destination alignment and stripe cut."""
    blocks = 6
    storage = torch.randint(0, 256, (3 * blocks * page + offset + 64,), dtype=torch.uint8)
    geometry = PlaneGeometry(blocks, page, 1, 0, 1, page, 0)
    group = [Plane(f"l{i}", "page", 0, torch.uint8, geometry, offset + i * blocks * page, storage) for i in range(3)]
    slots = torch.tensor(data.draw(st.lists(st.sampled_from([-1, 0, 1, 2, 3, 4, 5]), min_size=1, max_size=6,
                                            unique=True)), dtype=torch.int64)
    with crc_path(vectors):
        check(group, slots, stripe, before, data.draw(st.integers(0, 999)), data.draw(st.integers(0, 1000)))


@PATHS
def test_a_parallel_load_over_many_stripes(vectors):
    """Over the parallel threshold (several threads, several grabs): the default 64 KiB stripes, token rows."""
    planes, slots = parallel_group()
    assert buffer_bytes(planes, slots.numel()) > 16 * 64 * 1024
    with crc_path(vectors):
        check(planes, slots, 64 * 1024, 1000, 8, 3)


def _small() -> tuple[list[Plane], torch.Tensor]:
    storage = torch.randint(0, 256, (4 * 16 * 256,), dtype=torch.uint8)
    geometry = PlaneGeometry(4, 16 * 256, 16, 256, 1, 256, 256)
    return [Plane("l0", "kv", 0, torch.uint8, geometry, 0, storage)], torch.arange(3, 40)


def test_the_default_load_hashes_before_it_copies():
    """A backend without its own hashing load (here `torch`) hashes the buffer, then loads: same result."""
    planes, slots = _small()
    check(planes, slots, 1000, 10, 5, 4, TORCH)


def test_a_planted_fault_is_caught():
    """Negative control: a byte of the object flipped before the load (in its last stripe) is copied into the
    KV cache, and exactly that stripe's CRC differs from the object's intact one."""
    planes, slots = _small()
    nbytes = buffer_bytes(planes, slots.numel())
    obj = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    intact = stripes_of(obj, 1000)
    obj[nbytes - 1] ^= 0x10
    got = hashed_load(planes, slots, obj, 0, 1000)
    assert (got != intact).nonzero().flatten().tolist() == [intact.numel() - 1]
    assert torch.equal(got, stripes_of(obj, 1000))
