"""vLLM's CPU attention backend: its real cache-write kernel decides the layout we read, and rows read
through the probed layout are exactly the keys and values that kernel wrote."""

from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

from lmcache_platforms.integration.vllm.cpu_cache_probe import UnknownCacheLayout, probe_cpu_layout
from lmcache_platforms.kernels.contract import Direction
from lmcache_platforms.kernels.torch_backend import TorchBackend
from lmcache_platforms.layout.tensors import TensorLayout, planes_from_tensor


@pytest.mark.parametrize(("dtype", "block_size", "head_size"),
                         [(torch.bfloat16, 32, 64), (torch.float32, 128, 64), (torch.float16, 32, 80)])
def test_rows_read_through_the_probed_layout_are_what_vllm_wrote(dtype, block_size, head_size):
    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    hint = probe_cpu_layout(isa, dtype, block_size, head_size)
    assert hint in (TensorLayout.VLLM_CPU, TensorLayout.VLLM_CPU_K_TRANSPOSED)
    blocks, heads, tokens = 4, 2, 3 * block_size - 5
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    halves = cache.view(blocks, heads, 2 * block_size, head_size)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    slots = torch.arange(tokens) + block_size  # blocks 1..3
    ops.cpu_attn_reshape_and_cache(key, value, *halves.chunk(2, dim=2), slots, isa)
    planes = planes_from_tensor("layer", 0, cache, hint)
    buffer = torch.zeros(sum(p.row_bytes for p in planes) * tokens, dtype=torch.uint8)
    TorchBackend().transfer(planes, slots, buffer, Direction.STORE)
    # plane-major buffer: each plane's rows in plane order; K may be one plane per head (stored transposed)
    rows = buffer.view(dtype).split([p.row_bytes // dtype.itemsize * tokens for p in planes])
    part = {p.name: r.view(tokens, -1) for p, r in zip(planes, rows, strict=True)}
    k = torch.cat([part[p.name] for p in planes if p.name.split(".")[0] == "k"], dim=1)
    v = torch.cat([part[p.name] for p in planes if p.name.split(".")[0] == "v"], dim=1)
    k, v = k.view(tokens, heads, head_size), v.view(tokens, heads, head_size)
    assert torch.equal(k, key) and torch.equal(v, value)


def test_this_machines_vec_kernel_stores_k_transposed():
    isa = _get_attn_isa(torch.bfloat16, 32, 64, "auto")
    if isa != "vec":
        pytest.skip(f"this CPU uses isa {isa!r}")
    assert probe_cpu_layout(isa, torch.bfloat16, 32, 64) is TensorLayout.VLLM_CPU_K_TRANSPOSED


def test_a_kernel_we_cannot_probe_stops_with_a_clear_error():
    with pytest.raises(UnknownCacheLayout, match=r"isa=no-such-isa.*cannot probe the cache layout"):
        probe_cpu_layout("no-such-isa", torch.bfloat16, 32, 64)
