"""A small Gemma-3-style model with random weights, written once into a cache folder and reused.

No model hub is reachable here, so the demo builds its own model: a config, random weights and a word-level
tokenizer (so vLLM's OpenAI-compatible server takes text like any model's), with sliding-window and
full-attention layers (vLLM's hybrid KV-cache manager then makes several KV-cache groups), sized so that prefill
of a long prompt clearly dominates while the whole demo stays within minutes on a CPU.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from lmcache_platforms.tools.demo.tokenizer import WORD_TOKENIZER, save_word_tokenizer

DONE_MARKER = ".lmcache_platforms_model.json"


@dataclass(frozen=True)
class ModelSpec:
    """Shape of the random model; ``name`` is its cache folder, so any change of shape needs a new name."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    sliding_window: int
    full_attention_every: int
    max_model_len: int
    # Untied embeddings and a wider init than Gemma's 0.02: with Gemma's defaults greedy decoding of a random
    # model mostly repeats the last prompt token, which would make "identical outputs" prove little.
    tie_embeddings: bool = False
    init_range: float = 0.1
    seed: int = 0
    # What the folder's tokenizer is (see ``demo/tokenizer.py``); part of the spec so that older cached folders
    # without one are rebuilt.
    tokenizer: str = WORD_TOKENIZER

    def layer_types(self) -> list[str]:
        """Gemma-3's pattern: every ``full_attention_every``-th layer is full attention, the rest slide."""
        return [
            "full_attention" if (i + 1) % self.full_attention_every == 0 else "sliding_attention"
            for i in range(self.num_layers)
        ]


# Prefill of a 2,048-token prompt takes seconds on a 2-core CPU; one decode step stays in the tens of ms.
# A wide MLP makes prefill cost more without making the KV cache (what LMCache moves) any bigger.
DEMO_MODEL = ModelSpec(
    name="gemma3-demo-12L-1024h-8192i-v3", num_layers=12, hidden_size=1024, intermediate_size=8192, num_heads=8,
    num_kv_heads=4, head_dim=128, vocab_size=8192, sliding_window=512, full_attention_every=6,
    max_model_len=4096,
)
# For tests: a few layers, a few hundred tokens, seconds per pass.
TINY_MODEL = ModelSpec(
    name="gemma3-tiny-4L-256h-v2", num_layers=4, hidden_size=256, intermediate_size=512, num_heads=4,
    num_kv_heads=2, head_dim=64, vocab_size=2048, sliding_window=64, full_attention_every=4,
    max_model_len=1024,
)
# The same with every layer full attention: one KV-cache group (a dense model to vLLM).
TINY_DENSE_MODEL = replace(TINY_MODEL, name=f"{TINY_MODEL.name}-full1", full_attention_every=1)
MODELS = {"demo": DEMO_MODEL, "tiny": TINY_MODEL, "tiny-dense": TINY_DENSE_MODEL}


def with_context(model: ModelSpec, tokens: int) -> ModelSpec:
    """``model``, or a variant of it (its own name, so its own folder) whose context holds ``tokens`` tokens:
    the next power of two above them."""
    if tokens <= model.max_model_len:
        return model
    context = 1 << tokens.bit_length()
    return replace(model, name=f"{model.name}-ctx{context}", max_model_len=context)


def default_cache_dir() -> Path:
    """``$LMCACHE_PLATFORMS_CACHE`` or ``~/.cache/lmcache_platforms``; models live under ``models/``."""
    root = os.environ.get("LMCACHE_PLATFORMS_CACHE") or Path.home() / ".cache" / "lmcache_platforms"
    return Path(root) / "models"


def _is_complete(folder: Path, spec: ModelSpec) -> bool:
    marker = folder / DONE_MARKER
    return marker.is_file() and json.loads(marker.read_text()) == asdict(spec)


def ensure_model(
    spec: ModelSpec, cache_dir: Path | None = None, progress: Callable[[str], None] = lambda _msg: None
) -> Path:
    """The folder holding ``spec``'s model, created (config + random bf16 weights) on first use.

    A marker file written last says the folder is complete, so an interrupted run is redone, never reused.
    """
    folder = (cache_dir or default_cache_dir()) / spec.name
    if _is_complete(folder, spec):
        progress(f"model {spec.name}: reusing {folder}")
        return folder
    progress(f"model {spec.name}: creating random weights in {folder} (once)")
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers, num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, query_pre_attn_scalar=spec.head_dim,
        sliding_window=spec.sliding_window, layer_types=spec.layer_types(),
        max_position_embeddings=spec.max_model_len, tie_word_embeddings=spec.tie_embeddings,
        initializer_range=spec.init_range, dtype="bfloat16",
    )
    config.architectures = ["Gemma3ForCausalLM"]
    torch.manual_seed(spec.seed)
    model = Gemma3ForCausalLM(config).bfloat16()
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=folder.parent))
    try:
        model.save_pretrained(staging)
        save_word_tokenizer(staging, spec.vocab_size)
        (staging / DONE_MARKER).write_text(json.dumps(asdict(spec)))
        _publish(staging, folder, spec)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return folder


def _publish(staging: Path, folder: Path, spec: ModelSpec) -> None:
    """Moves a complete model into place in one rename, so that processes creating the same model at once (test
    workers) never read another's half-written files; the first to finish wins, an incomplete leftover goes."""
    try:
        staging.rename(folder)
    except OSError:
        if _is_complete(folder, spec):
            return
        shutil.rmtree(folder, ignore_errors=True)
        staging.rename(folder)
