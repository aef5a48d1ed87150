"""The connector refuses what would corrupt a cache, before moving a byte, and says why."""

from __future__ import annotations

import pytest
import torch
from lmcache.v1.memory_allocators.ad_hoc_memory_allocator import AdHocMemoryAllocator
from lmcache.v1.memory_management import MemoryFormat

from lmcache_platforms.connector.paged import LayoutGPUConnector
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions
from lmcache_platforms.tools.fixtures import materialize

pytestmark = pytest.mark.slow


def _bound(name: str = "gemma3") -> LayoutGPUConnector:
    connector = LayoutGPUConnector(kernel_backend="torch")
    connector.bind(materialize(load_layout_spec(name), seed=0))
    return connector


def _memory_obj(shape: torch.Size):
    return AdHocMemoryAllocator("cpu").allocate(shape, torch.uint8, MemoryFormat.KV_2LTD)


def test_a_chunk_of_another_size_is_refused_on_load() -> None:
    connector = _bound()
    wrong = _memory_obj(torch.Size([1, 1, 64, 7]))
    with pytest.raises(TransferError, match=r"chunk \[0, 64\) holds 448 bytes, this layout's chunks 114752"):
        connector.batched_to_gpu([wrong], [0], [64], block_ids=([1, 2, 3, 4], [5, 6, 7, 8]))


def test_a_partial_chunk_of_a_multi_group_layout_is_refused_on_store() -> None:
    connector = _bound()
    assert connector.fmt is not None
    chunk = _memory_obj(connector.fmt.shape)
    before = chunk.tensor.clone()
    with pytest.raises(TransferError, match=r"chunk \[64, 100\) is partial"):
        connector.batched_from_gpu([chunk], [64], [100], block_ids=([1] * 7, [2] * 7))
    assert torch.equal(chunk.tensor, before)


def test_the_engine_surfaces_a_missing_block_table() -> None:
    layout = materialize(load_layout_spec("llama"), seed=0)
    with LayoutEngine(layout, StorageOptions(max_local_cpu_size=0.02)) as engine, \
            pytest.raises(TransferError, match="needs the kwarg block_ids"):
        engine.engine.store(torch.arange(128), request_configs=engine.tags)
