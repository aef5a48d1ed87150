"""``transfer_chunks``: a batch of chunks moved by one call, the same bytes as ``torch`` moving each chunk alone.

The default (chunk by chunk, every chunk checked first) runs under the native CPU and torch backends; the
Triton backend's one launch per batch is checked by the interpreter and GPU tests with the same checks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.kernels.contract import buffer_bytes
from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.kernels.torch_backend import BACKEND as TORCH
from lmcache_platforms.kernels.torch_backend import TorchBackend
from tests.kernels.checks import assert_chunks_match_torch, check_chunk_refusals, small_group
from tests.kernels.strategies import chunk_cases

needs_cpu = pytest.mark.skipif(not CPU.availability()[0], reason=CPU.availability()[1])


@needs_cpu
@settings(max_examples=60, deadline=None)
@given(case=chunk_cases(), seed=st.integers(0, 1000))
def test_the_native_backend_moves_a_batch_as_torch_moves_each_chunk(case, seed):
    assert_chunks_match_torch(CPU, *case, seed)


@pytest.mark.parametrize("backend", [pytest.param(CPU, marks=needs_cpu, id="cpu"), pytest.param(TORCH, id="torch")])
def test_a_bad_chunk_anywhere_in_the_batch_refuses_the_whole_batch(backend):
    check_chunk_refusals(backend)


class PackedChunks(TorchBackend):
    """A planted fault: chunks written back to back, whatever the stride asked for."""

    def transfer_chunks(self, planes, slots, buffer, chunk_stride, direction):
        per_chunk = buffer_bytes(planes, slots.shape[-1])
        super().transfer_chunks(planes, slots, buffer, per_chunk, direction)


def test_the_batch_check_catches_chunks_at_the_wrong_stride():
    """Negative control for ``assert_chunks_match_torch``: a gap between chunks that the backend ignores."""
    slots = torch.tensor([[0, 1], [2, 3]], dtype=torch.int64)
    assert_chunks_match_torch(PackedChunks(), small_group(), slots, 0, 0)  # no gap: the fault is invisible
    with pytest.raises(AssertionError):
        assert_chunks_match_torch(PackedChunks(), small_group(), slots, 3, 0)
