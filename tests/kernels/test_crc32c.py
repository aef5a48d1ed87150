"""The native CRC-32C behind the chunk checksum: the standard check value, the instruction and the table agree
with a bit-by-bit reference, and stripes are the CRCs of their own bytes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels.crc32c import native

pytestmark = pytest.mark.skipif(native() is None, reason="the native CPU library is not built")


def reference(data: bytes) -> int:
    """CRC-32C one bit at a time, straight from its definition (reflected 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)


def test_the_standard_check_value() -> None:
    lib = native()
    assert lib is not None
    buf = _tensor(b"123456789")
    assert lib.crc(buf.data_ptr(), 9) == lib.portable_crc(buf.data_ptr(), 9) == 0xE3069283


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200), st.integers(0, 7))
def test_instruction_table_and_definition_agree(data: bytes, offset: int) -> None:
    """At every alignment (the offset shifts the start inside the buffer) and length."""
    lib = native()
    assert lib is not None
    buf = _tensor(bytes(offset) + data)
    address = buf.data_ptr() + offset
    assert lib.crc(address, len(data)) == lib.portable_crc(address, len(data)) == reference(data)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 5000), st.integers(1, 700), st.data())
def test_stripes_are_the_crcs_of_their_bytes(nbytes: int, stripe: int, data: st.DataObject) -> None:
    """Runs of three (the interleaved path), the short last stripe, and any sub-range of stripes."""
    lib = native()
    assert lib is not None
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    count = -(-nbytes // stripe)
    first = data.draw(st.integers(0, count - 1))
    last = data.draw(st.integers(first + 1, count))
    out = torch.zeros(count, dtype=torch.int32)
    lib.stripes(buf.data_ptr(), nbytes, stripe, first, last, out.data_ptr())
    raw = bytes(buf.numpy())
    assert out.numpy().view("<u4")[: last - first].tolist() == [
        reference(raw[k * stripe : (k + 1) * stripe]) for k in range(first, last)]


@settings(max_examples=60, deadline=None)
@given(st.binary(min_size=0, max_size=9000), st.integers(0, 63), st.sampled_from([512, 128, 0]))
def test_the_vector_fold_agrees_with_the_table(data: bytes, offset: int, vectors: int) -> None:
    """Lengths past the 512-bit fold's start (512 bytes; 256-byte steps, a tail of any length) at every
    alignment, and without it (the crc32 instruction, from 4 KiB on three thirds at once, joined by shifting:
    with PCLMULQDQ allowed (128) by carry-less multiplies, else bit by bit): the table's value, the definition's
    too. (The 128-bit fold runs inside copies only: test_hashing_store.)"""
    lib = native()
    assert lib is not None
    buf = _tensor(bytes(offset) + data)
    address = buf.data_ptr() + offset
    previous = lib.allow_vectors(vectors)
    try:
        assert lib.crc(address, len(data)) == lib.portable_crc(address, len(data)) == reference(data)
    finally:
        lib.allow_vectors(previous)


@pytest.mark.parametrize("vectors", [512, 128, 0], ids=["fold512", "fold128", "no-fold"])
@pytest.mark.parametrize("nbytes", [4096, 4097, 6001, 9000, 65536, 3 * 65536 + 5])
def test_long_buffers_agree_with_the_table(vectors: int, nbytes: int) -> None:
    """Lengths where the crc32 instruction hashes three thirds at once: their join (carry-less multiplies with
    PCLMULQDQ allowed, else bit by bit) gives the table's value; also under the 512-bit fold."""
    lib = native()
    assert lib is not None
    buf = torch.randint(0, 256, (nbytes + 3,), dtype=torch.uint8, generator=torch.Generator().manual_seed(nbytes))
    previous = lib.allow_vectors(vectors)
    try:
        for start in (0, 3):
            assert lib.crc(buf.data_ptr() + start, nbytes) == lib.portable_crc(buf.data_ptr() + start, nbytes)
    finally:
        lib.allow_vectors(previous)
