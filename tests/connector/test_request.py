"""The kwarg contract: per-group block tables, and whole chunks only when several groups are saved."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lmcache_platforms.connector.request import block_ids_from, check_chunk, int64_tensor
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.fixtures import plan

GEMMA = plan(load_layout_spec("gemma3"))
LLAMA = plan(load_layout_spec("llama"))


def test_block_ids_become_cpu_int64_tensors_per_group() -> None:
    ids = block_ids_from({"block_ids": ([1, 2], torch.tensor([3, 0], dtype=torch.int32))}, GEMMA)
    assert [t.tolist() for t in ids] == [[1, 2], [3, 0]]
    assert all(t.dtype == torch.int64 and t.device.type == "cpu" for t in ids)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"slot_mapping": torch.arange(4)}, r"needs the kwarg block_ids=.*got only \['slot_mapping'\]"),
    ({"block_ids": torch.tensor([1, 2])}, "must be a sequence with one block list per group, got Tensor"),
    ({"block_ids": ([1, 2],)}, "has 1 block lists; the layout saves group 1"),
    ({"block_ids": ([1, 2], [3, -4])}, r"block_ids\[1\] holds negative block id -4"),
])
def test_bad_block_ids_are_refused_with_the_reason(kwargs: dict, message: str) -> None:
    with pytest.raises(TransferError, match=message):
        block_ids_from(kwargs, GEMMA)


def test_partial_chunks_only_for_a_single_saved_group() -> None:
    check_chunk(GEMMA, 64, 128)
    check_chunk(LLAMA, 256, 300)
    with pytest.raises(TransferError, match=r"chunk \[256, 300\) is partial but the layout saves groups \[0, 1\]"):
        check_chunk(GEMMA, 256, 300)


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=300))
def test_int64_tensor_holds_what_torch_tensor_holds(values: list[int]) -> None:
    """The fast path for token and block ids: the same dtype, shape and values as ``torch.tensor``, empty too,
    and a tensor of its own (the list changed afterwards does not change it)."""
    tensor = int64_tensor(values)
    assert tensor.dtype == torch.int64 and tensor.device.type == "cpu"
    assert torch.equal(tensor, torch.tensor(values, dtype=torch.int64))
    values.append(7)
    assert tensor.numel() == len(values) - 1
