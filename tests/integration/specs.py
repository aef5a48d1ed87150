"""Real vLLM 0.32 KV-cache specs and configs for the integration tests (a Gemma-3-like hybrid model)."""

from __future__ import annotations

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

BLOCK = 32
HEADS, HEAD = 1, 64


def full(block: int = BLOCK) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16)


def sliding(window: int, block: int = BLOCK) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.bfloat16,
                             sliding_window=window)


def compressed(ratio: int, block: int = 128) -> MLAAttentionSpec:
    return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=HEAD, dtype=torch.bfloat16,
                            tokens_per_state=ratio)


def mamba(block: int = BLOCK, mode: str = "none", **kwargs) -> MambaSpec:
    """A GDN-like state: a bf16 conv plane and a float32 SSM plane per block."""
    return MambaSpec(block_size=block, shapes=((3, 16), (2, 8, 8)), dtypes=(torch.bfloat16, torch.float32),
                     mamba_cache_mode=mode, **kwargs)


def group(names: list[str], spec, **kwargs) -> KVCacheGroupSpec:
    return KVCacheGroupSpec(layer_names=names, kv_cache_spec=spec, **kwargs)


def gemma_like(window: int = 64, num_blocks: int = 64) -> KVCacheConfig:
    """Gemma-3 as vLLM's hybrid manager groups it: three sliding-window layers and one full-attention layer,
    one layer per group, one shared block pool."""
    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    groups = [group([names[3]], full())] + [group([n], sliding(window)) for n in names[:3]]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[KVCacheTensor(
        size=1, layers=names, layer_stride=1, block_stride=1)], kv_cache_groups=groups)
