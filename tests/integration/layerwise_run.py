"""One in-process vLLM engine (CPU) with our connector, generating the same prompt twice, for the layerwise tests.

``python -m tests.integration.layerwise_run MODEL OPTIONS_JSON``; options: ``layerwise`` (LMCache's
``use_layerwise``), ``single_group`` (vLLM's hybrid KV-cache manager off: one group, loads in the step that
computes the request), ``store`` (a folder: LMCache's ``fs://`` backend there, shared between runs), ``plant``
(``"zero_first_layer"``: layerwise loads write zeros instead of the first layer's rows, the negative control).
Prints one JSON line: each pass's tokens and top-5 logprobs, our connector's counters, and how many layers one
store or load call of each chunk format moves apart.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does

PROMPT = [(i * 37) % 2000 + 1 for i in range(300)]


def plant_zero_first_layer() -> None:
    """Layerwise loads write zeros in place of the first layer's rows (a fault the identity oracle must catch),
    unchecked, whether the layers are checked as they load (stripe checks) or the objects first."""
    import torch

    from lmcache_platforms.connector.binding import LayoutBinding

    load = LayoutBinding.load_chunks

    def zeroing(self, fmt, hosts, slots, launches, checks=None):  # type: ignore[no-untyped-def]
        if launches and launches[0].planes[0].layer == self.layout.model_layers[0]:
            return load(self, fmt, [torch.zeros_like(host) for host in hosts], slots, launches)
        return load(self, fmt, hosts, slots, launches, checks)

    LayoutBinding.load_chunks = zeroing  # type: ignore[method-assign]


def main(model: str, options: dict[str, Any]) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    extra: dict[str, Any] = {"lmcache.chunk_size": 64, "lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.5,
                             "lmcache.use_layerwise": bool(options.get("layerwise"))}
    if options.get("store"):
        extra.update({"lmcache.remote_url": f"fs://localhost:0{options['store']}", "lmcache.remote_serde": "naive"})
    if options.get("single_group"):
        extra["platforms.load_mode"] = "sync"
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=1024,
              enable_prefix_caching=False, disable_hybrid_kv_cache_manager=bool(options.get("single_group")),
              kv_transfer_config={"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": extra})
    if options.get("plant") == "zero_first_layer":
        plant_zero_first_layer()
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
    passes = []
    for _ in range(2):
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params)[0].outputs[0]
        passes.append({"tokens": list(out.token_ids),
                       "logprobs": [sorted((t, v.logprob) for t, v in step.items()) for step in out.logprobs]})
    worker = get_kv_transfer_group()
    connector = worker.impl.lmcache_engine.gpu_connector
    binding = connector.binding
    counters = binding.counters
    print(json.dumps({
        "groups": len(worker.impl.plan.saved), "passes": passes,
        "chunks_stored": counters.chunks_stored, "chunks_loaded": counters.chunks_loaded,
        "layers_stored": counters.layers_stored, "layers_loaded": counters.layers_loaded,
        "layers_per_format": [len(binding.layer_launches(fmt)) for fmt in binding.formats],
    }))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
