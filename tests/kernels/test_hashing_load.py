"""The load that hashes as it copies (``KernelBackend.load_hashed``): the same rows as a plain load, and stripe
CRC-32Cs equal to hashing the object (``check_load``, which ``test_hashing_store`` runs on random layouts, stripe
sizes, object offsets, threads and every CRC path beside the store). Its verdict comes after the copy, so a
corrupt byte is written and must be seen in the stripes."""

from __future__ import annotations

import pytest
import torch

from lmcache_platforms.kernels.contract import Direction, buffer_bytes
from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.kernels.crc32c import native
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.crc_paths import hashed_move, stripes_of

pytestmark = pytest.mark.skipif(native() is None or not CPU.availability()[0], reason="the native library is not built")


def _storages(planes) -> list[torch.Tensor]:
    return list({id(p.storage): p.storage for p in planes}.values())


def check_load(planes, slots, stripe: int, before: int, after: int, seed: int, backend=CPU) -> None:
    nbytes = buffer_bytes(planes, slots.shape[-1])
    gen = torch.Generator().manual_seed(seed)
    obj = torch.randint(0, 256, (before + nbytes + after,), dtype=torch.uint8, generator=gen)
    original = [s.clone() for s in _storages(planes)]
    TORCH.transfer(planes, slots, obj[before : before + nbytes], Direction.LOAD)
    expected = [s.clone() for s in _storages(planes)]
    for storage, saved in zip(_storages(planes), original, strict=True):
        storage.copy_(saved)
    got = hashed_move(backend.load_hashed, planes, slots, obj, before, stripe)
    for storage, want in zip(_storages(planes), expected, strict=True):
        assert torch.equal(storage, want), "the hashing load wrote other bytes than a plain load"
    assert torch.equal(got, stripes_of(obj, stripe))


def _small() -> tuple[list[Plane], torch.Tensor]:
    storage = torch.randint(0, 256, (4 * 16 * 256,), dtype=torch.uint8)
    geometry = PlaneGeometry(4, 16 * 256, 16, 256, 1, 256, 256)
    return [Plane("l0", "kv", 0, torch.uint8, geometry, 0, storage)], torch.arange(3, 40)


def test_the_default_load_hashes_before_it_copies():
    """A backend without its own hashing load (here `torch`) hashes the buffer, then loads: same result."""
    planes, slots = _small()
    check_load(planes, slots, 1000, 10, 5, 4, TORCH)


def test_a_planted_fault_is_caught():
    """Negative control: a byte of the object flipped before the load (in its last stripe) is copied into the
    KV cache, and exactly that stripe's CRC differs from the object's intact one."""
    planes, slots = _small()
    nbytes = buffer_bytes(planes, slots.numel())
    obj = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    intact = stripes_of(obj, 1000)
    obj[nbytes - 1] ^= 0x10
    got = hashed_move(CPU.load_hashed, planes, slots, obj, 0, 1000)
    assert (got != intact).nonzero().flatten().tolist() == [intact.numel() - 1]
    assert torch.equal(got, stripes_of(obj, 1000))


def test_one_native_call_verifies_every_object_of_a_load():
    """``unverified``: each object's hashed stripes against the table it carries. Exact indices of the corrupt
    ones; a table that fails its trailer is no table; states out of their allocation's order, or missing bytes,
    are a bug and raise."""
    from lmcache_platforms.connector import checksum

    payload = 3 * checksum.STRIPE_BYTES + 777
    gen = torch.Generator().manual_seed(2)
    objects = [torch.randint(0, 256, (payload + checksum.tail_bytes(payload),), dtype=torch.uint8, generator=gen)
               for _ in range(4)]
    checksum.seal(objects, payload)
    objects[1][5] ^= 0x01
    objects[3][payload - 1] ^= 0x80
    tables = checksum.carried_tables(objects, payload)
    assert tables is not None
    hashing = checksum.object_stripes(payload, len(objects))
    for obj, state in zip(objects, hashing, strict=True):
        state.feed(obj[:payload], 0)
    assert checksum.unverified(hashing, tables) == [1, 3]
    with pytest.raises(ValueError, match="one stripe_states call, in its order"):
        checksum.unverified(hashing[::-1], tables)
    partial = checksum.object_stripes(payload, 1)
    partial[0].feed(objects[0][: payload - 1], 0)
    with pytest.raises(RuntimeError, match="did not get every payload byte exactly once"):
        checksum.unverified(partial, tables[:1])
    objects[2][payload + 1] ^= 0x01  # its stripe table
    assert checksum.carried_tables(objects, payload) is None
