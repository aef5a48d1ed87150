"""The CPU backend's store and load that hash as they copy: the same bytes as a plain store or load, and stripe
CRC-32Cs equal to hashing the finished object, on random layouts, stripe sizes, object offsets, threads and every
CRC path (the 512-, 256- and 128-bit folds where this CPU has them, the crc32 instruction or table otherwise)."""

from __future__ import annotations

import subprocess
import sys

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
from tests.kernels.crc_paths import PATHS, crc_path, hashed_move, native_crc, stripes_of
from tests.kernels.strategies import interleaved_cases, transfer_cases
from tests.kernels.test_hashing_load import check_load

pytestmark = pytest.mark.skipif(native() is None or not CPU.availability()[0], reason="the native library is not built")


def check_store(planes, slots, stripe: int, before: int, after: int, seed: int) -> None:
    nbytes = buffer_bytes(planes, slots.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    obj = torch.randint(0, 256, (before + nbytes + after,), dtype=torch.uint8, generator=gen)
    expected = obj.clone()
    TORCH.transfer(planes, slots, expected[before : before + nbytes], Direction.STORE)
    got = hashed_move(CPU.store_hashed, planes, slots, obj, before, stripe)
    assert torch.equal(obj, expected), "the hashing store wrote other bytes than a plain store"
    assert torch.equal(got, stripes_of(obj, stripe))


MOVES = pytest.mark.parametrize("check", [check_store, check_load], ids=["store", "load"])


@MOVES
@PATHS
@settings(max_examples=80, deadline=None)
@given(case=st.one_of(transfer_cases(), interleaved_cases()), stripe=st.integers(1, 3000),
       before=st.integers(0, 5000), after=st.integers(0, 3000), seed=st.integers(0, 1000))
def test_random_layouts_hash_as_they_move(check, vectors, case, stripe, before, after, seed):
    """Strided segments, transposed tiles, runs and skipped rows, cut by stripes anywhere (inside a row too)."""
    with crc_path(vectors):
        check(*case, stripe, before, after, seed)


@MOVES
@PATHS
@settings(max_examples=25, deadline=None)
@given(page=st.integers(8 * 1024 - 3, 48 * 1024), offset=st.integers(0, 63), stripe=st.integers(300, 70000),
       before=st.integers(0, 70000), data=st.data())
def test_block_pages_hash_inside_the_streaming_copy(check, vectors, page, offset, stripe, before, data):
    """Whole pages: runs from 32 KiB (a store) or 8 KiB (a load) go through streaming stores, hashed in the same
    loop, at every destination alignment and stripe cut."""
    blocks = 6
    storage = torch.randint(0, 256, (3 * blocks * page + offset + 64,), dtype=torch.uint8)
    geometry = PlaneGeometry(blocks, page, 1, 0, 1, page, 0)
    group = [Plane(f"l{i}", "page", 0, torch.uint8, geometry, offset + i * blocks * page, storage) for i in range(3)]
    slots = torch.tensor(data.draw(st.lists(st.sampled_from([-1, 0, 1, 2, 3, 4, 5]), min_size=1, max_size=6,
                                            unique=True)), dtype=torch.int64)
    with crc_path(vectors):
        check(group, slots, stripe, before, data.draw(st.integers(0, 999)), data.draw(st.integers(0, 1000)))


@MOVES
@PATHS
def test_a_parallel_move_over_many_stripes(check, vectors):
    """Over the parallel threshold (several threads, several grabs): the default 64 KiB stripes, token rows."""
    planes, slots = parallel_group()
    assert buffer_bytes(planes, slots.numel()) > 16 * 64 * 1024
    with crc_path(vectors):
        check(planes, slots, 64 * 1024, 1000, 8, 3)


def test_the_default_store_hashes_after_it_copies():
    """A backend without its own hashing store (here `torch`) stores, then hashes the buffer: same result."""
    storage = torch.randint(0, 256, (4 * 16 * 256,), dtype=torch.uint8)
    geometry = PlaneGeometry(4, 16 * 256, 16, 256, 1, 256, 256)
    planes = [Plane("l0", "kv", 0, torch.uint8, geometry, 0, storage)]
    slots = torch.arange(3, 40)
    obj = torch.zeros(buffer_bytes(planes, 37) + 10, dtype=torch.uint8)
    assert torch.equal(hashed_move(TORCH.store_hashed, planes, slots, obj, 10, 1000), stripes_of(obj, 1000))


def test_a_planted_fault_is_caught():
    """Negative control: the oracle compares every stripe. A byte flipped after the store (or a piece of the
    object never hashed) makes the stripes differ, or the state refuses to finish."""
    storage = torch.randint(0, 256, (4 * 16 * 256,), dtype=torch.uint8)
    geometry = PlaneGeometry(4, 16 * 256, 16, 256, 1, 256, 256)
    planes = [Plane("l0", "kv", 0, torch.uint8, geometry, 0, storage)]
    slots = torch.arange(0, 48)
    obj = torch.zeros(buffer_bytes(planes, 48), dtype=torch.uint8)
    got = hashed_move(CPU.store_hashed, planes, slots, obj, 0, 5000)
    obj[7777] ^= 1
    assert not torch.equal(got, stripes_of(obj, 5000))
    assert (got != stripes_of(obj, 5000)).sum() == 1
    stripes = native_crc().object_stripes(obj.numel() + 1, 5000)
    CPU.store_hashed(planes, slots, obj, stripes, 0)
    with pytest.raises(RuntimeError, match=f"{obj.numel()} payload bytes were hashed, the object has "
                                           f"{obj.numel() + 1}"):
        stripes.finish(torch.zeros_like(stripes.registers))
    with pytest.raises(RuntimeError, match=r"payload bytes \[5, 8\) overrun the 12289-byte payload's stripes, "
                                           "12288 bytes hashed before them"):
        stripes.feed(obj[:3], 5)


@PATHS
@settings(max_examples=40, deadline=None)
@given(nbytes=st.integers(1, 300_000), stripe=st.sampled_from([1, 7, 4096, 65536]), data=st.data())
def test_pieces_join_in_any_order(vectors, nbytes, stripe, data):
    """An object's bytes fed in pieces cut anywhere, in any order (a layer-by-layer store hashes each layer's
    pieces as the forward writes them): the stripes of a pass over the object. Negative control: with the last
    piece left out and the first fed twice, each step is refused or finishes with other stripes."""
    obj = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    cuts = sorted(set(data.draw(st.lists(st.integers(1, nbytes - 1), max_size=12)) if nbytes > 1 else []))
    pieces = list(zip([0, *cuts], [*cuts, nbytes], strict=True))
    order = data.draw(st.permutations(range(len(pieces))))
    with crc_path(vectors):
        stripes = native_crc().object_stripes(nbytes, stripe)
        for index in order:
            start, end = pieces[index]
            stripes.feed(obj[start:end], start)
        out = torch.zeros_like(stripes.registers)
        stripes.finish(out)
        assert torch.equal(out, stripes_of(obj, stripe))
        if len(pieces) > 1:
            twice = native_crc().object_stripes(nbytes, stripe)
            for start, end in [*pieces[:-1], pieces[0]]:
                try:
                    twice.feed(obj[start:end], start)
                    twice.finish(out)
                except RuntimeError:
                    continue
                assert not torch.equal(out, stripes_of(obj, stripe))


def test_a_hashing_store_as_the_first_crc_of_a_process():
    """The fold's constants are built on first use, whichever entry point comes first: here the store, in a
    fresh interpreter, over one whole 64 KiB-page chunk on two threads (a build that skipped them hashed every
    stripe wrong)."""
    script = (
        "import torch\n"
        "from lmcache_platforms.kernels.cpu_backend import BACKEND\n"
        "from lmcache_platforms.kernels.crc32c import native\n"
        "from lmcache_platforms.layout.plane import Plane, PlaneGeometry\n"
        "torch.set_num_threads(2)\n"
        "storage = torch.randint(0, 256, (8 * 65536,), dtype=torch.uint8)\n"
        "planes = [Plane('l0', 'kv', 0, torch.uint8, PlaneGeometry(8, 65536, 16, 4096, 1, 4096, 4096), 0, storage)]\n"
        "obj = torch.zeros(8 * 65536, dtype=torch.uint8)\n"
        "lib = native()\n"
        "stripes = lib.object_stripes(obj.numel(), 65536)\n"
        "BACKEND.store_hashed(planes, torch.arange(128), obj, stripes, 0)\n"
        "got = torch.zeros(8, dtype=torch.int32)\n"
        "stripes.finish(got)\n"
        "want = torch.zeros(8, dtype=torch.int32)\n"
        "lib.stripes(obj.data_ptr(), obj.numel(), 65536, 0, 8, want.data_ptr())\n"
        "print((got != want).sum().item())\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip().splitlines()[-1] == "0"
