"""Where vLLM's CPU attention backend really puts K and V, found by asking the backend itself.

The CPU cache is declared ``[blocks, kv_heads, block_size, 2 * head_size]`` but the bytes inside one
(block, head) page depend on the kernel ISA the backend picked (K is stored transposed for ``vec``; other
ISAs may pack differently). Guessing wrong would silently corrupt every reloaded cache, so we write known
keys and values through vLLM's own cache-write op into a scratch page and compare the result with the
layouts we can move: K and V in rows, K transposed, or each (block, head) half-page holding its own tokens in
tiles (AMX), which is moved only as whole block pages. Anything else stops the connector at
``register_kv_caches``. An fp8 cache (``--kv-cache-dtype
fp8``, ``fp8_e4m3``, ``fp8_e5m2``: one byte per element, the layer's scale applied by vLLM on the way in and out)
is probed with values fp8 holds exactly, so its bytes are known too; the chunks carry those bytes unchanged.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcache_platforms.layout.tensors import TensorLayout


class UnknownCacheLayout(RuntimeError):
    """vLLM's CPU backend stores K/V in a way no plane description of ours matches."""


FP8_CACHE_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
"""vLLM cache dtypes stored as plain fp8 bytes, with the format of those bytes."""
# Exact in both fp8 formats (two mantissa bits suffice): a cast stores them unrounded.
_FP8_EXACT = torch.tensor([0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def _write_scratch(isa: str, dtype: torch.dtype, block_size: int, head_size: int, key: torch.Tensor,
                   value: torch.Tensor, slots: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    from vllm import _custom_ops as ops

    num_blocks, heads = 2, key.shape[1]
    cache = torch.zeros(num_blocks, heads, block_size, 2 * head_size, dtype=dtype)
    halves = cache.view(num_blocks, heads, 2 * block_size, head_size)
    key_cache, value_cache = halves.chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa, kv_cache_dtype=kv_cache_dtype)
    return cache


def _inputs(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, fp8: torch.dtype | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """K or V as written (in ``dtype``) and the values the cache should hold (as the cache's bytes for fp8)."""
    if fp8 is None:
        written = torch.randn(shape, generator=gen).to(dtype)
        return written, written
    written = _FP8_EXACT[torch.randint(len(_FP8_EXACT), shape, generator=gen)].to(dtype)
    return written, written.to(fp8).view(torch.uint8)


def _holds_own_rows(part: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether each (block, head) half-page holds exactly its own tokens' values, in whatever order (AMX tiles):
    such a page can be moved whole, never row by row."""
    flat_part = part.reshape(part.shape[0], part.shape[1], -1)
    flat_want = want.reshape(want.shape[0], want.shape[1], -1)
    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[part.element_size()]
    return torch.equal(flat_part.view(as_int).sort(dim=-1).values, flat_want.view(as_int).sort(dim=-1).values)


@functools.cache
def probe_cpu_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int, kv_cache_dtype: str = "auto",
                     input_dtype: torch.dtype = torch.bfloat16) -> TensorLayout:
    """The TensorLayout vLLM's CPU cache-write kernel produces for this ISA, cache dtype and page shape
    (``input_dtype``: the model's, what an fp8 cache is written from)."""
    heads, num_blocks = 2, 2
    tokens = num_blocks * block_size
    gen = torch.Generator().manual_seed(1234)
    fp8 = FP8_CACHE_DTYPES.get(kv_cache_dtype)
    written_dtype = dtype if fp8 is None else input_dtype
    key, stored_key = _inputs(gen, (tokens, heads, head_size), written_dtype, fp8)
    value, stored_value = _inputs(gen, (tokens, heads, head_size), written_dtype, fp8)
    slots = torch.randperm(tokens, generator=gen)
    where = (f"vLLM CPU attention (isa={isa}, dtype={dtype}, kv_cache_dtype={kv_cache_dtype}, "
             f"block_size={block_size}, head_size={head_size})")
    try:
        cache = _write_scratch(isa, dtype, block_size, head_size, key, value, slots, kv_cache_dtype)
    except Exception as exc:
        raise UnknownCacheLayout(f"{where}: cannot probe the cache layout ({type(exc).__name__}: {exc})") from exc
    # Token t went to slot slots[t]: expected[b, h, r] is the token whose slot is b * block_size + r.
    order = torch.empty_like(slots)
    order[slots] = torch.arange(tokens)
    want_k = stored_key[order].view(num_blocks, block_size, heads, head_size).transpose(1, 2)
    want_v = stored_value[order].view(num_blocks, block_size, heads, head_size).transpose(1, 2)
    page = cache.view(num_blocks, heads, 2 * block_size * head_size)
    k_part = page[..., : block_size * head_size]
    v_part = page[..., block_size * head_size :].reshape(num_blocks, heads, block_size, head_size)
    if not torch.equal(v_part, want_v):
        if _holds_own_rows(k_part, want_k) and _holds_own_rows(v_part, want_v):
            return TensorLayout.VLLM_CPU_PAGES
        raise UnknownCacheLayout(f"{where}: V is not stored [block_size x head_size] after K; "
                                 "this layout is not supported, refusing to offload a cache we cannot read")
    if torch.equal(k_part.reshape(num_blocks, heads, block_size, head_size), want_k):
        return TensorLayout.VLLM_CPU
    if torch.equal(k_part.reshape(num_blocks, heads, head_size, block_size).transpose(-1, -2), want_k):
        return TensorLayout.VLLM_CPU_K_TRANSPOSED
    if _holds_own_rows(k_part, want_k):
        return TensorLayout.VLLM_CPU_PAGES
    raise UnknownCacheLayout(f"{where}: K is stored neither [block_size x head_size] nor transposed; "
                             "this layout is not supported, refusing to offload a cache we cannot read")


def tiled_block_sizes(kv_cache_groups: Sequence[Any], model_dtype: torch.dtype, cache_dtype: str,
                      isa_of: Callable[[torch.dtype, int, int, str], str]) -> list[int]:
    """Block sizes (tokens) of the attention groups whose CPU cache vLLM keeps in AMX tiles (``isa_of``: vLLM's
    choice of kernel ISA): their rows move only as whole block pages, so a chunk must cover whole blocks."""
    sizes = []
    for group in kv_cache_groups:
        spec = group.kv_cache_spec
        head_size, dtype = getattr(spec, "head_size", None), getattr(spec, "dtype", None)
        if not isinstance(head_size, int) or not isinstance(dtype, torch.dtype):
            continue
        written = model_dtype if cache_dtype in FP8_CACHE_DTYPES else dtype
        try:
            isa = isa_of(written, spec.block_size, head_size, cache_dtype)
        except NotImplementedError:
            continue
        if isa == "amx":
            sizes.append(spec.block_size)
    return sizes
