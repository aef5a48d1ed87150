"""A real vLLM 0.32 config for a tiny Gemma-3-like model (config file only: nothing is run or loaded), and what
vLLM's CPU backend refuses on this machine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

CHUNK = 64
BLOCK = 32
LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def write_model_config(folder: Path, window: int = 64) -> Path:
    """A Gemma-3 text config (3 sliding-window layers, then one full-attention layer); no weights."""
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64, sliding_window=window,
        layer_types=["sliding_attention"] * 3 + ["full_attention"], max_position_embeddings=1024,
        torch_dtype="bfloat16",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    config.save_pretrained(folder)
    return folder


def vllm_config(model: Path, connector: str, disable_hma: bool | None = None, **extra: Any) -> Any:
    """``VllmConfig`` as ``vllm serve`` builds it, with ``--kv-transfer-config`` naming ``connector``."""
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs

    from lmcache_platforms.integration.vllm.registration import register_connectors

    register_connectors()
    # These stacks' tests compare the cache's bytes before and after a load themselves: no poison.
    extra_config = {"lmcache.chunk_size": CHUNK, "lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.2,
                    "platforms.poison_loads": False, **extra}
    args = EngineArgs(
        model=str(model), skip_tokenizer_init=True, enforce_eager=True, block_size=BLOCK, max_model_len=1024,
        kv_transfer_config=KVTransferConfig(kv_connector=connector, kv_role="kv_both",
                                            kv_connector_extra_config=extra_config),
        disable_hybrid_kv_cache_manager=disable_hma,
    )
    return args.create_engine_config()


def scheduler_output(new: Any = (), cached: Any = None, scheduled: dict[str, int] | None = None,
                     finished: Any = ()) -> Any:
    """A real ``SchedulerOutput`` for one step: new and cached requests, tokens scheduled, finished ids."""
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput

    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=list(new), scheduled_cached_reqs=cached or CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(finished),
        free_encoder_mm_hashes=[])


def fp8_cache_refusal() -> str | None:
    """vLLM's own reason for refusing an fp8 KV cache on this CPU (the check its attention backend runs at engine
    start), or None: a test skips before starting an engine or a server that would fail on it."""
    import torch
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    try:
        _get_attn_isa(torch.bfloat16, BLOCK, 64, "fp8")
    except NotImplementedError as exc:
        return str(exc)
    return None
