"""Tiny random recurrent-state hybrids made with ``transformers`` (nothing can be downloaded), by name.

Each has 3 recurrent layers (vLLM ``MambaSpec`` groups) and 1 full-attention layer, hidden 256, vocab 2,048, bf16,
seed 0; ``initializer_range`` 0.1 keeps greedy output varied. Only models vLLM 0.32's CPU build runs in align mode
are here; docs/support-matrix.md says which it refuses and why (Qwen3.5, Mamba2 and Mamba1 hybrids, OLMo-Hybrid).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SPEC = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128, "num_experts": 4, "num_experts_per_tok": 2,
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 64,
        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "max_position_embeddings": 16384, "tie_word_embeddings": False, "initializer_range": 0.1,
        "decoder_sparse_step": 1, "mlp_only_layers": []}

# LFM2: 3 gated short-convolution layers (state: conv planes only). ``conv_dim`` and ``block_dim`` are read by
# vLLM 0.32 and written by the published LFM2 configs, but no longer set by transformers' ``Lfm2Config``.
LFM2 = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "layer_types": ["conv"] * 3 + ["full_attention"],
        "conv_dim": 256, "block_dim": 256, "max_position_embeddings": 16384, "tie_word_embeddings": False,
        "initializer_range": 0.1}


@dataclass(frozen=True)
class TinyModel:
    """The ``transformers`` config class, the model class (also the architecture vLLM resolves), the spec."""

    config: str
    model: str
    spec: dict


MODELS = {
    "qwen3-next": TinyModel("Qwen3NextConfig", "Qwen3NextForCausalLM", SPEC),
    "lfm2": TinyModel("Lfm2Config", "Lfm2ForCausalLM", LFM2),
}


def ensure_tiny(name: str, folder: Path) -> Path:
    """Model ``name`` in ``folder`` (random bf16 weights, seed 0), written once; the marker is written last, so a
    folder a killed run left half written is rebuilt."""
    tiny = MODELS[name]
    marker = folder / f".tiny_{name}.json"
    if marker.is_file() and json.loads(marker.read_text()) == tiny.spec:
        return folder
    import torch
    import transformers

    config = getattr(transformers, tiny.config)(**tiny.spec, torch_dtype="bfloat16")
    config.architectures = [tiny.model]
    torch.manual_seed(0)
    getattr(transformers, tiny.model)(config).to(torch.bfloat16).save_pretrained(folder)
    marker.write_text(json.dumps(tiny.spec))
    return folder


def ensure_tiny_qwen3_next(folder: Path) -> Path:
    """The tiny Qwen3-Next (3 gated-delta-net layers, 1 full-attention layer, 4 small experts)."""
    return ensure_tiny("qwen3-next", folder)
