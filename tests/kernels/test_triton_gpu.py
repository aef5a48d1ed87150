"""The Triton backend compiled by Triton's JIT and run on this machine's GPU (CUDA or XPU) against the torch
oracle on the same device: what ``make device-check`` adds to the CPU suite.

CI has no GPU, so there these skip and claim nothing: the kernel's compilation for GPUs is proven there by
``test_triton_aot.py``, what it computes by the interpreter tests. ``make device-check`` fails when they skip.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels import triton_backend
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from tests.kernels.checks import assert_chunks_match_torch, assert_load_matches_torch, assert_store_matches_torch
from tests.kernels.strategies import chunk_cases, on_device, storage_of, transfer_cases


def gpu() -> torch.device | None:
    """The first CUDA or XPU device, None without one."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    xpu = getattr(torch, "xpu", None)
    return torch.device("xpu", 0) if xpu is not None and xpu.is_available() else None


DEVICE = gpu()
NO_GPU = "no CUDA or XPU device: the Triton kernel runs on a GPU only under `make device-check` on a GPU machine"
pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_GPU)


@settings(max_examples=200, deadline=None)
@given(case=transfer_cases(max_planes=4, max_rows=12), seed=st.integers(0, 1000))
def test_store_and_load_match_torch_on_the_gpu(case, seed):
    assert DEVICE is not None
    planes, slots = on_device(*case, DEVICE)
    backend = triton_backend.TritonBackend()
    assert_store_matches_torch(backend, planes, slots, seed)
    assert_load_matches_torch(backend, planes, slots, seed)


@settings(max_examples=100, deadline=None)
@given(case=chunk_cases(max_planes=4, max_rows=12), seed=st.integers(0, 1000))
def test_a_batch_of_chunks_in_one_launch_matches_torch_on_the_gpu(case, seed):
    assert DEVICE is not None
    planes, slots, gap = case
    planes, slots = on_device(planes, slots, DEVICE)
    assert_chunks_match_torch(triton_backend.TritonBackend(), planes, slots, gap, seed)


@pytest.mark.parametrize("block", [8, triton_backend.TritonBackend.block])
@pytest.mark.parametrize("unit", triton_backend.UNITS)
def test_every_unit_and_multi_piece_rows_on_the_gpu(unit, block):
    """Rows wider than one program's block (and within one), K and V segments interleaved, each unit width."""
    assert DEVICE is not None
    storage = storage_of(torch.randint(0, 256, (3 * 192 * unit,), dtype=torch.uint8, device=DEVICE))
    geometry = PlaneGeometry(3, 192 * unit, 4, 48 * unit, 8, 3 * unit, 6 * unit)
    planes = [Plane("l", "k", 0, torch.uint8, geometry, 0, storage),
              Plane("l", "v", 0, torch.uint8, geometry, 3 * unit, storage)]
    slots = torch.tensor([5, 6, -1, 0, 11], dtype=torch.int64, device=DEVICE)
    backend = triton_backend.TritonBackend()
    backend.block = block
    assert triton_backend.transfer_unit(planes, 0) == unit
    assert_store_matches_torch(backend, planes, slots, unit)
    assert_load_matches_torch(backend, planes, slots, unit)


@settings(max_examples=20, deadline=None)
@given(objects=st.integers(1, 16), payload_words=st.integers(1, 600_000), gap_words=st.integers(0, 64),
       seed=st.integers(0, 2**31))
def test_stripe_crcs_on_the_gpu_match_the_native_crc(objects, payload_words, gap_words, seed):
    """The chunk checksum's GPU kernel (``kernels.triton_crc32c``) against the native CRC-32C, up to 16 objects
    of up to 2.4 MB side by side; then one flipped bit changes exactly its stripe's value."""
    from lmcache_platforms.kernels import triton_crc32c
    from lmcache_platforms.kernels.crc32c import native

    lib = native()
    if lib is None:
        pytest.skip("the native CPU library is not built: nothing to compare the GPU's CRC-32C with")
    assert DEVICE is not None
    payload, stride = 4 * payload_words, 4 * (payload_words + gap_words)
    host = torch.randint(0, 256, ((objects - 1) * stride + payload,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))

    def native_stripes() -> torch.Tensor:
        return lib.stripes_of_objects(host, objects, stride, payload, triton_crc32c.STRIPE_BYTES)

    before = triton_crc32c.stripe_crcs(host.to(DEVICE), objects, stride, payload).cpu()
    assert torch.equal(before, native_stripes())
    where = seed % payload + (objects - 1) * stride
    host[where] ^= 1 << (seed % 8)
    after = triton_crc32c.stripe_crcs(host.to(DEVICE), objects, stride, payload).cpu()
    assert torch.equal(after, native_stripes())
    assert (before != after).nonzero().tolist() == [[objects - 1, (where - (objects - 1) * stride) // (64 << 10)]]
