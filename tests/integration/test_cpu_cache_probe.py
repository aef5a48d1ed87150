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
from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.tensors import TensorLayout, planes_from_tensor


@pytest.mark.parametrize(("dtype", "block_size", "head_size"),
                         [(torch.bfloat16, 32, 64), (torch.float32, 128, 64), (torch.float16, 32, 80)])
def test_rows_read_through_the_probed_layout_are_what_vllm_wrote(dtype, block_size, head_size):
    isa = _get_attn_isa(dtype, block_size, head_size, "auto")
    hint = probe_cpu_layout(isa, dtype, block_size, head_size)
    blocks, heads, tokens = 4, 2, 3 * block_size - 5
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=dtype)
    halves = cache.view(blocks, heads, 2 * block_size, head_size)
    gen = torch.Generator().manual_seed(7)
    key = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    value = torch.randn(tokens, heads, head_size, generator=gen).to(dtype)
    slots = torch.arange(tokens) + block_size  # blocks 1..3
    ops.cpu_attn_reshape_and_cache(key, value, *halves.chunk(2, dim=2), slots, isa)
    planes = planes_from_tensor("layer", 0, cache, hint)
    if hint is TensorLayout.VLLM_CPU_PAGES:
        assert_moved_as_whole_pages(planes, cache, block_size)
        return
    assert hint in (TensorLayout.VLLM_CPU, TensorLayout.VLLM_CPU_K_TRANSPOSED)
    buffer = torch.zeros(sum(p.row_bytes for p in planes) * tokens, dtype=torch.uint8)
    TorchBackend().transfer(planes, slots, buffer, Direction.STORE)
    # plane-major buffer: each plane's rows in plane order; K may be one plane per head (stored transposed)
    rows = buffer.view(dtype).split([p.row_bytes // dtype.itemsize * tokens for p in planes])
    part = {p.name: r.view(tokens, -1) for p, r in zip(planes, rows, strict=True)}
    k = torch.cat([part[p.name] for p in planes if p.name.split(".")[0] == "k"], dim=1)
    v = torch.cat([part[p.name] for p in planes if p.name.split(".")[0] == "v"], dim=1)
    k, v = k.view(tokens, heads, head_size), v.view(tokens, heads, head_size)
    assert torch.equal(k, key) and torch.equal(v, value)


def assert_moved_as_whole_pages(planes, cache: torch.Tensor, block_size: int) -> None:
    """AMX tiles: no row may be moved alone (a token layout is refused), and block rows carry every page of
    the blocks written (1..3) into an empty cache byte for byte, and nothing of block 0."""
    group = KVGroup(0, block_size, layer_names=("layer",))
    with pytest.raises(LayoutError, match=r"layer 'layer': its rows can be moved only as whole block pages"):
        KVLayout.build([group], {"layer": planes}, 2 * block_size, rows="tokens")
    layout = KVLayout.build([group], {"layer": planes}, 2 * block_size, rows="blocks")
    (tg,) = layout.transfer_groups
    assert [p.pages_only for p in tg.planes] == [True] and layout.whole_chunks_only
    block_slots = torch.tensor([1, 2, 3])
    buffer = torch.zeros(tg.planes[0].row_bytes * 3, dtype=torch.uint8)
    TorchBackend().transfer(tg.planes, block_slots, buffer, Direction.STORE)
    original = cache.clone()
    cache.zero_()
    TorchBackend().transfer(tg.planes, block_slots, buffer, Direction.LOAD)
    assert torch.equal(cache, original) and original[1:].any() and not original[0].any()


def test_this_machines_vec_kernel_stores_k_transposed():
    isa = _get_attn_isa(torch.bfloat16, 32, 64, "auto")
    if isa != "vec":
        pytest.skip(f"this CPU uses isa {isa!r}")
    assert probe_cpu_layout(isa, torch.bfloat16, 32, 64) is TensorLayout.VLLM_CPU_K_TRANSPOSED


def test_a_kernel_we_cannot_probe_stops_with_a_clear_error():
    with pytest.raises(UnknownCacheLayout, match=r"isa=no-such-isa.*cannot probe the cache layout"):
        probe_cpu_layout("no-such-isa", torch.bfloat16, 32, 64)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_fp8_rows_read_through_the_probed_layout_are_the_bytes_vllm_wrote(kv_cache_dtype):
    """fp8 caches: the bytes vLLM's kernel wrote (values divided by the layer's scale, then cast), in the layout
    the probe found; values fp8 holds exactly, so the expected bytes are a plain cast."""
    from lmcache_platforms.integration.vllm.cpu_cache_probe import FP8_CACHE_DTYPES

    block_size, head_size, scale = 32, 64, 2.0
    try:
        isa = _get_attn_isa(torch.bfloat16, block_size, head_size, kv_cache_dtype)
    except NotImplementedError as exc:
        pytest.skip(f"vLLM's CPU backend has no fp8 cache on this CPU: {exc}")
    hint = probe_cpu_layout(isa, torch.uint8, block_size, head_size, kv_cache_dtype, torch.bfloat16)
    blocks, heads, tokens = 4, 2, 3 * block_size - 5
    cache = torch.zeros(blocks, heads, block_size, 2 * head_size, dtype=torch.uint8)
    halves = cache.view(blocks, heads, 2 * block_size, head_size)
    gen = torch.Generator().manual_seed(7)
    exact = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -1.0, -3.0, -6.0])
    key, value = (exact[torch.randint(len(exact), (tokens, heads, head_size), generator=gen)] * scale
                  for _ in range(2))
    slots = torch.arange(tokens) + block_size
    ops.cpu_attn_reshape_and_cache(key.bfloat16(), value.bfloat16(), *halves.chunk(2, dim=2), slots, isa,
                                   k_scale=scale, v_scale=scale, kv_cache_dtype=kv_cache_dtype)
    planes = planes_from_tensor("layer", 0, cache, hint)
    if hint is TensorLayout.VLLM_CPU_PAGES:
        assert_moved_as_whole_pages(planes, cache, block_size)
        return
    assert hint in (TensorLayout.VLLM_CPU, TensorLayout.VLLM_CPU_K_TRANSPOSED)
    buffer = torch.zeros(sum(p.row_bytes for p in planes) * tokens, dtype=torch.uint8)
    TorchBackend().transfer(planes, slots, buffer, Direction.STORE)
    rows = buffer.split([p.row_bytes * tokens for p in planes])
    part = {p.name: r.view(tokens, -1) for p, r in zip(planes, rows, strict=True)}
    k = torch.cat([part[p.name] for p in planes if p.name.split(".")[0] == "k"], dim=1)
    v = torch.cat([part[p.name] for p in planes if p.name.split(".")[0] == "v"], dim=1)
    fp8 = FP8_CACHE_DTYPES[kv_cache_dtype]
    assert torch.equal(k.view(tokens, heads, head_size), (key / scale).to(fp8).view(torch.uint8))
    assert torch.equal(v.view(tokens, heads, head_size), (value / scale).to(fp8).view(torch.uint8))
    other = torch.float8_e5m2 if fp8 is torch.float8_e4m3fn else torch.float8_e4m3fn
    assert not torch.equal(k.view(tokens, heads, head_size), (key / scale).to(other).view(torch.uint8))


def test_attention_groups_in_amx_tiles_are_the_ones_whose_blocks_a_chunk_must_cover():
    """vLLM's own ISA choice decides; only attention specs are asked, a group it refuses is not tiled, and an fp8
    cache is asked about with the model's dtype (what vLLM's kernel writes from)."""
    from lmcache_platforms.integration.vllm.cpu_cache_probe import tiled_block_sizes
    from tests.integration.specs import full, group, mamba, sliding

    asked = []

    def isa_of(dtype, block_size, head_size, cache_dtype):
        asked.append((dtype, block_size, cache_dtype))
        if block_size == 64:
            raise NotImplementedError("no such cache here")
        return "amx" if dtype is torch.bfloat16 and block_size % 32 == 0 else "vec"

    groups = [group(["a"], full(block=128)), group(["b"], sliding(64, block=64)), group(["m"], mamba())]
    assert tiled_block_sizes(groups, torch.bfloat16, "auto", isa_of) == [128]
    assert [a[1] for a in asked] == [128, 64]
    asked.clear()
    assert tiled_block_sizes(groups[:1], torch.bfloat16, "fp8", isa_of) == [128]
    assert asked == [(torch.bfloat16, 128, "fp8")]
