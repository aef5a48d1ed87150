"""Run the tiny Gemma-3-like model in real vLLM (one process, CPU) twice on one prompt with our connector
(``kv_connector_extra_config`` entries may be added as a JSON object in the second argument).

Prints one JSON line: whether vLLM kept its hybrid KV-cache manager, the KV-cache groups, chunks stored
and loaded by our connector, the two outputs, and the engines' health. Run as a module in a subprocess.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does


def main(model: str, extra: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    from vllm.inputs import TokensPrompt

    from lmcache_platforms.integration.vllm import health

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=1024,
              enable_prefix_caching=False, kv_transfer_config={
                  "kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"lmcache.chunk_size": 64, "lmcache.local_cpu": True,
                                                "lmcache.max_local_cpu_size": 0.5, **extra}})
    params = SamplingParams(max_tokens=8, temperature=0)
    prompt = TokensPrompt(prompt_token_ids=[(i * 37) % 2000 + 1 for i in range(300)])
    outputs = [list(llm.generate([prompt], params)[0].outputs[0].token_ids) for _ in range(2)]
    worker = get_kv_transfer_group()
    counters = worker.impl.lmcache_engine.gpu_connector.binding.counters
    print(json.dumps({
        "hma": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
        "groups": worker.impl.plan.describe(),
        "chunks_stored": counters.chunks_stored, "chunks_loaded": counters.chunks_loaded,
        "outputs": outputs, "health": health.engine_health(),
    }))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
