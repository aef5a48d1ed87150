"""The GPU stripe CRC-32C (``kernels.triton_crc32c``) under Triton's interpreter on CPU: the same values as the
native CRC-32C for every stripe of several objects side by side, short last stripes included, and a flipped
bit changes exactly its own stripe's value."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels import triton_crc32c
from lmcache_platforms.kernels.crc32c import native
from tests.ci import missing

pytestmark = pytest.mark.skipif(native() is None, reason="the native CPU library is not built")


@pytest.fixture(autouse=True)
def interpreting() -> Iterator[None]:
    try:
        import triton  # noqa: F401
    except ImportError as exc:
        missing(f"triton is not installed ({exc})")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        triton_crc32c._kernel.cache_clear()
        yield
    triton_crc32c._kernel.cache_clear()


def native_stripes(buf: torch.Tensor, objects: int, object_bytes: int, payload_bytes: int) -> torch.Tensor:
    lib = native()
    assert lib is not None
    return lib.stripes_of_objects(buf, objects, object_bytes, payload_bytes, triton_crc32c.STRIPE_BYTES)


def test_the_stripe_size_is_the_chunk_checksums() -> None:
    from lmcache_platforms.connector import checksum

    assert triton_crc32c.STRIPE_BYTES == checksum.STRIPE_BYTES


@settings(max_examples=6, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40_000), st.integers(0, 8), st.integers(0, 2**31))
def test_every_stripe_matches_the_native_crc(objects: int, payload_words: int, gap_words: int, seed: int) -> None:
    """Objects of up to 160 KB (a short last stripe, or the only one), each ``gap`` words after the last."""
    payload = 4 * payload_words
    stride = payload + 4 * gap_words
    buf = torch.randint(0, 256, ((objects - 1) * stride + payload,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(seed))
    got = triton_crc32c.stripe_crcs(buf, objects, stride, payload)
    assert torch.equal(got, native_stripes(buf, objects, stride, payload))


def test_a_flipped_bit_changes_its_stripe_only() -> None:
    """Negative control for the comparison above: one bit of the second object's second stripe."""
    payload, objects = 2 * triton_crc32c.STRIPE_BYTES - 8, 2
    buf = torch.randint(0, 256, (objects * payload,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    before = native_stripes(buf, objects, payload, payload)
    buf[payload + triton_crc32c.STRIPE_BYTES + 1234] ^= 16
    after = triton_crc32c.stripe_crcs(buf, objects, payload, payload)
    assert torch.equal(after, native_stripes(buf, objects, payload, payload))
    assert (before != after).nonzero().tolist() == [[1, 1]]


@pytest.mark.parametrize(("payload", "stride", "offset"), [(6, 8, 0), (8, 10, 0), (8, 8, 2)])
def test_buffers_it_cannot_read_in_words_are_refused(payload: int, stride: int, offset: int) -> None:
    buf = torch.zeros(64, dtype=torch.uint8)[offset:]
    assert not triton_crc32c.supported(buf, payload, stride)
    with pytest.raises(ValueError, match=f"cannot hash 2 objects of {payload} payload bytes every {stride} bytes"):
        triton_crc32c.stripe_crcs(buf, 2, stride, payload)
