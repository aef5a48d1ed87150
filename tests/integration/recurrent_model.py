"""A tiny random Qwen3-Next (gated delta net) hybrid made with ``transformers``: 3 ``linear_attention``
layers (recurrent state: conv + SSM planes) and 1 ``full_attention`` layer, 4 small experts."""

from __future__ import annotations

import json
from pathlib import Path

SPEC = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 16384, "tie_word_embeddings": False, "initializer_range": 0.1,
        "decoder_sparse_step": 1, "mlp_only_layers": []}
DONE = ".tiny_qwen3_next.json"


def ensure_tiny_qwen3_next(folder: Path) -> Path:
    """The model in ``folder`` (random bf16 weights, seed 0), written once; a marker written last."""
    marker = folder / DONE
    if marker.is_file() and json.loads(marker.read_text()) == SPEC:
        return folder
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**SPEC, torch_dtype="bfloat16")
    config.architectures = ["Qwen3NextForCausalLM"]
    torch.manual_seed(0)
    Qwen3NextForCausalLM(config).to(torch.bfloat16).save_pretrained(folder)
    marker.write_text(json.dumps(SPEC))
    return folder
