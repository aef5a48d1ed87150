"""The KV layout built from what ``register_kv_caches`` receives, in both vLLM generations' shapes."""

from __future__ import annotations

import pytest
import torch

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.groups import plan_groups
from lmcache_platforms.integration.vllm.registered_layout import build_layout, kernel_rows_per_block
from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.tensors import TensorLayout
from tests.integration.specs import full, gemma_like, group, mamba

SETTINGS = PlatformSettings()
NO_HINT = lambda *_: None  # noqa: E731 - shapes are unambiguous here


def shared_buffer_views(num_blocks: int, names: list[str], block: int = 32, heads: int = 1, head: int = 64):
    """vLLM 0.32 on CPU: every layer a [nb, h, bs, 2d] bf16 view into one int8 buffer."""
    page = heads * block * 2 * head * 2
    buffer = torch.zeros(len(names) * num_blocks * page, dtype=torch.int8)
    return {
        name: buffer[i * num_blocks * page : (i + 1) * num_blocks * page].view(torch.bfloat16)
        .view(num_blocks, heads, block, 2 * head)
        for i, name in enumerate(names)
    }


def test_vllm_032_cpu_shared_buffer_one_transfer_group_per_kv_group():
    config = gemma_like(num_blocks=16)
    caches = shared_buffer_views(16, [g.layer_names[0] for g in config.kv_cache_groups])
    plan = plan_groups(config.kv_cache_groups, SETTINGS)
    layout = build_layout(caches, plan, 64, SETTINGS, lambda *_: TensorLayout.VLLM_CPU_K_TRANSPOSED, 16)
    assert [tg.group for tg in layout.transfer_groups] == [0, 1, 2, 3]
    assert layout.multi_group
    # sliding window 64 = chunk: every row of a chunk is kept; in block rows (the default) two 32-token blocks,
    # each layer's K (transposed) and V of its block merged into one 8 KiB page
    assert [tg.rows_per_chunk for tg in layout.transfer_groups] == [2] * 4
    assert [[(p.geometry.segments, p.row_bytes) for p in tg.planes] for tg in layout.transfer_groups] == [
        [(1, 32 * 2 * 64 * 2)]] * 4
    tokens = build_layout(caches, plan, 64, PlatformSettings(chunk_rows="tokens"),
                          lambda *_: TensorLayout.VLLM_CPU_K_TRANSPOSED, 16)
    assert [tg.rows_per_chunk for tg in tokens.transfer_groups] == [64] * 4
    assert [tg.bytes_per_chunk for tg in tokens.transfer_groups] == [tg.bytes_per_chunk
                                                                     for tg in layout.transfer_groups]


def test_vllm_023_tensors_tuples_and_lists():
    groups = [group(["fa"], full()), group(["tup"], full()), group(["lst"], full())]
    plan = plan_groups(groups, SETTINGS)
    caches = {
        "fa": torch.zeros(8, 2, 32, 1, 64, dtype=torch.bfloat16),  # FlashAttention (nb, 2, bs, H, D)
        "tup": (torch.zeros(8, 32, 1, 64), torch.zeros(8, 32, 1, 64)),  # NPU (k, v), each [nb, bs, H, D]
        "lst": [torch.zeros(8, 32, 576, dtype=torch.bfloat16), torch.zeros(8, 32, 132, dtype=torch.int8)],
    }
    layout = build_layout(caches, plan, 64, PlatformSettings(chunk_rows="tokens"), NO_HINT, 8)
    planes = {(p.layer, p.name) for tg in layout.transfer_groups for p in tg.planes}
    assert planes == {("fa", "k"), ("fa", "v"), ("tup", "0"), ("tup", "1"), ("lst", "0"), ("lst", "1")}
    # In block rows FlashAttention's K and V pages of a block are one stretch: one plane; the others are
    # separate tensors, which never merge.
    blocks = build_layout(caches, plan, 64, SETTINGS, NO_HINT, 8)
    assert {(p.layer, p.name) for tg in blocks.transfer_groups for p in tg.planes} == {
        ("fa", "k+1"), ("tup", "0"), ("tup", "1"), ("lst", "0"), ("lst", "1")}


def test_only_saved_groups_are_described():
    plan = plan_groups([group(["a"], full()), group(["m"], mamba())], SETTINGS)
    caches = {"a": torch.zeros(4, 32, 64), "m": [torch.zeros(4, 3), torch.zeros(4, 5, 7)]}
    layout = build_layout(caches, plan, 64, SETTINGS, NO_HINT, 4)
    assert [tg.group for tg in layout.transfer_groups] == [0]


def test_recurrent_layers_become_one_snapshot_row_per_block():
    """vLLM 0.32's CPU runner registers a GDN layer as one int8 view of each block's state bytes (conv + SSM)
    inside a padded page; vLLM 0.23 / other runners give the typed planes as a list. Both: one row per block."""
    plan = plan_groups([group(["a"], full()), group(["m", "t"], mamba(mode="align"))], SETTINGS,
                       64)
    pages = torch.zeros(4, 2, 1, 1, 768, dtype=torch.int8)
    typed = [torch.zeros(4, 3, 16, dtype=torch.bfloat16), torch.zeros(4, 2, 8, 8)]
    caches = {"a": torch.zeros(4, 32, 64), "m": pages[:, 0, :, :, :608], "t": typed}
    layout = build_layout(caches, plan, 64, SETTINGS, NO_HINT, 4)
    snapshot = next(tg for tg in layout.transfer_groups if tg.group == 1)
    assert snapshot.rows_per_chunk == 1 and snapshot.bytes_per_chunk == 2 * 608
    geometry = {(p.layer, p.name): (p.geometry.rows_per_block, p.geometry.block_stride, p.row_bytes)
                for p in snapshot.planes}
    assert geometry == {("m", "state0"): (1, 1536, 608), ("t", "state0"): (1, 96, 96),
                        ("t", "state1"): (1, 512, 512)}


def test_missing_layer_and_unreadable_tensor_stop_registration():
    plan = plan_groups([group(["a", "b"], full())], SETTINGS)
    with pytest.raises(ValueError, match=r"no tensor for layers \['b'\]"):
        build_layout({"a": torch.zeros(4, 32, 64)}, plan, 64, SETTINGS, NO_HINT, 4)
    with pytest.raises(LayoutError, match="layer 'a'"):
        build_layout({"a": torch.zeros(4, 7, 9, 64), "b": torch.zeros(4, 32, 64)}, plan, 64, SETTINGS, NO_HINT, 4)


def test_kernel_blocks_smaller_than_manager_blocks():
    grp = plan_groups([group(["a"], full(128))], SETTINGS).groups[0]
    assert kernel_rows_per_block(torch.zeros(40, 32, 64), grp, 10) == 32
    assert kernel_rows_per_block(torch.zeros(2, 40, 32, 64), grp, 10) == 128  # dim 0 is not blocks here
    assert kernel_rows_per_block(torch.zeros(10, 128, 64), grp, 10) == 128
