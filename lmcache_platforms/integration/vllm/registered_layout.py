"""The ``KVLayout`` of the caches vLLM hands to ``register_kv_caches``, in either vLLM generation.

0.32+ gives each layer a strided view into one shared buffer (its block count may be a multiple of the
scheduler's when kernel blocks are smaller than manager blocks); 0.23 / vllm-ascend gives tensors, tuples
of planes (K/V, MLA nope/rope, sparse K/V/index/scale) or lists of padded views. Only the layers of saved
groups are described. A recurrent (snapshot) group's layer gives its state as tensors ``[blocks, *state]``,
each one row per block: vLLM 0.32's CPU runner registers one int8 view of a block's conv + SSM bytes (inside
the padded page), other runners the typed conv and SSM planes. Ambiguous layouts are resolved from the
attention backend that owns the layer (vLLM's CPU backend is probed, never assumed); a layout we cannot
describe raises here, before anything is copied.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.cpu_cache_probe import FP8_CACHE_DTYPES, probe_cpu_layout
from lmcache_platforms.integration.vllm.groups import GroupPlan
from lmcache_platforms.integration.vllm.vllm_compat import cpu_attention_isa
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.kv_layout import KVLayout, LayerEntry
from lmcache_platforms.layout.plane import Plane
from lmcache_platforms.layout.tensors import Hint, planes_from_dims, planes_from_tensor

HintFor = Callable[[str, Any, KVGroup], Hint]


def _first_tensor(value: Any) -> torch.Tensor:
    return value if isinstance(value, torch.Tensor) else _first_tensor(value[0])


def kernel_rows_per_block(value: Any, group: KVGroup, num_blocks: int | None) -> int:
    """Rows per block inside the tensor: the group's, divided by kernel blocks per manager block."""
    tensor = _first_tensor(value)
    nb_dim = 1 if tensor.dim() == 5 and tensor.shape[0] == 2 else 0
    blocks = tensor.shape[nb_dim]
    if num_blocks and blocks > num_blocks and blocks % num_blocks == 0:
        ratio = blocks // num_blocks
        if group.block_size % ratio == 0:
            return group.block_size // ratio
    return group.block_size


KV_CACHE_DTYPE_TAG = "lmcache.tag.lmcp_kv_cache_dtype"


def cache_dtype_tags(vllm_config: Any) -> dict[str, str]:
    """A key tag naming vLLM's quantized cache dtype: fp8 caches are uint8 tensors on every platform, so e4m3
    and e5m2 chunks have the same layout fingerprint and must be kept apart by name."""
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    return {KV_CACHE_DTYPE_TAG: cache_dtype} if cache_dtype.startswith("fp8") else {}


def vllm_hint_for(vllm_config: Any) -> HintFor:
    """Hints from the running attention backends: vLLM's CPU backend is probed; others infer from shape."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    cache_dtype = str(getattr(getattr(vllm_config, "cache_config", None), "cache_dtype", "auto"))
    model_dtype = getattr(getattr(vllm_config, "model_config", None), "dtype", None)
    input_dtype = model_dtype if isinstance(model_dtype, torch.dtype) else torch.bfloat16

    def hint(layer_name: str, value: Any, group: KVGroup) -> Hint:
        backend = getattr(context.get(layer_name), "attn_backend", None)
        if backend is None:
            if _first_tensor(value).device.type == "cpu":
                raise ValueError(f"layer {layer_name!r}: vLLM registered no attention backend for it, so the "
                                 "layout of its CPU KV cache cannot be determined")
            return None
        if backend.get_name() != "CPU_ATTN":
            return None
        if not isinstance(value, torch.Tensor) or value.dim() != 4:
            raise ValueError(f"layer {layer_name!r}: vLLM's CPU attention cache should be one 4-D tensor, got "
                             f"{type(value).__name__}")
        if cache_dtype not in ("auto", "bfloat16", "float16", "float32", *FP8_CACHE_DTYPES):
            raise ValueError(f"layer {layer_name!r}: vLLM CPU KV cache dtype {cache_dtype!r} is not supported "
                             f"(supported: auto, bfloat16, float16, float32, {', '.join(FP8_CACHE_DTYPES)})")
        block_size, head_size = value.shape[2], value.shape[3] // 2
        isa = getattr(context.get(layer_name), "isa", None)
        if isa is None:
            isa = cpu_attention_isa(input_dtype if cache_dtype in FP8_CACHE_DTYPES else value.dtype, block_size,
                                    head_size, cache_dtype)
        return probe_cpu_layout(str(isa), value.dtype, block_size, head_size, cache_dtype, input_dtype)

    return hint


def snapshot_planes(layer_name: str, group: KVGroup, value: Any) -> list[Plane]:
    """A recurrent layer's state tensors, each ``[blocks, *state]``: one row (the whole state) per block."""
    items = [value] if isinstance(value, torch.Tensor) else list(value)
    planes: list[Plane] = []
    for i, tensor in enumerate(items):
        dims = ("nb", "bs", *(f"r{d}" for d in range(tensor.dim() - 1)))
        planes += planes_from_dims(layer_name, group.index, tensor.unsqueeze(1), dims, f"state{i}")
    return planes


def build_layout(
    kv_caches: Mapping[str, Any],
    plan: GroupPlan,
    chunk_size: int,
    settings: PlatformSettings,
    hint_for: HintFor,
    num_blocks: int | None = None,
) -> KVLayout:
    """Describe the saved groups' layers of ``kv_caches`` (layer name -> tensor / tuple / list of planes)."""
    group_of = {name: plan.groups[i] for i in plan.saved for name in plan.groups[i].layer_names}
    missing = [name for name in group_of if name not in kv_caches]
    if missing:
        raise ValueError(f"register_kv_caches got no tensor for layers {missing[:4]} of saved groups "
                         f"{sorted({group_of[n].index for n in missing})}")
    entries: list[LayerEntry] = []
    for name, value in kv_caches.items():
        group = group_of.get(name)
        if group is None:
            continue
        if group.kind.snapshots:
            entries.append(LayerEntry(name, tuple(snapshot_planes(name, group, value))))
            continue
        items = value if isinstance(value, torch.Tensor) else list(value)
        rows = kernel_rows_per_block(value, group, num_blocks)
        planes = planes_from_tensor(name, group.index, items, hint_for(name, value, group), block_size=rows)
        entries.append(LayerEntry(name, tuple(planes)))
    blocks = dict.fromkeys(plan.saved, num_blocks) if num_blocks else None
    # plan_groups alone decides which groups are saved; the layout carries exactly those.
    return KVLayout.build(plan.saved_groups, entries, chunk_size, mode=settings.mode, saved=plan.saved,
                          num_blocks=blocks, rows=settings.chunk_rows)
