"""What the checksum kernels' tests share: the native CRC-32C, the oracle that hashes a finished object, and
every CRC path this CPU has (``PATHS``, ``crc_path``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from lmcache_platforms.kernels.crc32c import NativeCrc32c, ObjectCheck, native
from lmcache_platforms.layout.plane import buffer_bytes


def native_crc() -> NativeCrc32c:
    lib = native()
    assert lib is not None
    return lib


def stripes_of(obj: torch.Tensor, stripe: int) -> torch.Tensor:
    """The oracle: the finished object's stripes hashed from memory, one by one."""
    out = torch.zeros(-(-obj.numel() // stripe), dtype=torch.int32)
    native_crc().stripes(obj.data_ptr(), obj.numel(), stripe, 0, out.numel(), out.data_ptr())
    return out


def hashed_move(move, planes, slots, obj: torch.Tensor, offset: int, stripe: int) -> torch.Tensor:
    """Moves the planes to or from ``obj`` at ``offset`` with ``move`` (a backend's ``store_hashed`` or
    ``load_hashed``), the bytes around them fed from memory, and returns the stripe CRCs it built."""
    nbytes = buffer_bytes(planes, slots.shape[-1])
    stripes = native_crc().object_stripes(obj.numel(), stripe)
    stripes.feed(obj[:offset], 0)
    move(planes, slots, obj[offset : offset + nbytes], stripes, offset)
    stripes.feed(obj[offset + nbytes :], offset + nbytes)
    out = torch.zeros_like(stripes.registers)
    stripes.finish(out)
    return out


def check_against(obj: torch.Tensor, payload_bytes: int, stripe: int, expected: torch.Tensor) -> ObjectCheck:
    """A load's check of ``obj`` against the stripe CRCs ``expected`` (the objects of these tests carry none):
    its room as ``NativeCrc32c.open_objects`` fills it, the expected CRCs then one zeroed state per stripe."""
    room = torch.cat([expected, torch.zeros_like(expected)])
    return ObjectCheck(native_crc(), obj, payload_bytes, stripe, room, 0, expected.numel(), room.data_ptr())


@contextlib.contextmanager
def crc_path(widest: int) -> Iterator[None]:
    """The carry-less fold capped at ``widest`` bits (512, 256, 128; 0: the crc32 instruction or the table) for the
    test's duration; on a CPU without the wider fold the narrower path runs."""
    previous = native_crc().allow_vectors(widest)
    try:
        yield
    finally:
        native_crc().allow_vectors(previous)


PATHS = pytest.mark.parametrize("vectors", [512, 256, 128, 0], ids=["fold512", "fold256", "fold128", "no-fold"])
