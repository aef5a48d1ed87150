"""One in-process vLLM CPU engine on the tiny Qwen3-Next in align mode, with or without our connector.

``python -m tests.integration.recurrent_run MODEL STORE MODE [SKIP_GROUPS [MAX_NUM_BATCHED_TOKENS]]`` runs the
prompts given as JSON on stdin one request at a time (greedy) and prints one JSON line: each request's tokens,
top-5 logprobs and cached tokens, our group plan, chunks stored and loaded, and the engines' health. MODE
``connector`` uses LMCache with a persistent ``fs://`` store in STORE; ``plain`` runs vLLM alone with prefix
caching off; ``align`` runs vLLM alone with its own prefix caching in align mode.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does

BLOCK = 256  # vLLM's unified block size for this model (attention pages padded to the Mamba page)
TOP_K = 5


def engine_args(mode: str, store: str, skip_groups: str, max_batched: int) -> dict:
    args = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": 1024, "max_num_seqs": 4,
            "max_num_batched_tokens": max_batched}
    if mode == "plain":
        return {**args, "enable_prefix_caching": False}
    if mode == "align":
        return {**args, "enable_prefix_caching": True, "mamba_cache_mode": "align"}
    extra = {"lmcache.chunk_size": BLOCK, "lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.5,
             "lmcache.remote_url": f"fs://localhost:0{store}", "lmcache.remote_serde": "naive"}
    if skip_groups:
        extra["platforms.skip_groups"] = skip_groups
    return {**args, "enable_prefix_caching": True, "mamba_cache_mode": "align",
            "kv_transfer_config": {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": extra}}


def main(model: str, store: str, mode: str, skip_groups: str = "", max_batched: int = BLOCK) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_platforms.integration.vllm import health

    prompts = json.loads(sys.stdin.read())
    llm = LLM(model=model, **engine_args(mode, store, skip_groups, max_batched))
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=TOP_K)
    runs = []
    for prompt in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        runs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                     "logprobs": [sorted((v.logprob, k) for k, v in step.items())[::-1][:TOP_K]
                                  for step in out.outputs[0].logprobs]})
    result = {"runs": runs, "health": health.engine_health()}
    if mode == "connector":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        impl = get_kv_transfer_group().impl
        counters = impl.lmcache_engine.gpu_connector.binding.counters
        result.update(plan=impl.plan.describe(), hits_allowed=impl.plan.hits_allowed, why=impl.plan.why_no_hits(),
                      chunks_stored=counters.chunks_stored, chunks_loaded=counters.chunks_loaded)
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4], *sys.argv[4:5], *(int(a) for a in sys.argv[5:6]))
