"""One in-process vLLM CPU engine on a tiny recurrent hybrid in align mode, with or without our connector.

``python -m tests.integration.recurrent_run MODEL STORE MODE`` (MODEL: a folder ``recurrent_model.ensure_tiny``
wrote) reads a JSON job on stdin:

- ``prompts``: token id lists, run one request at a time, greedy; ``max_tokens``: one, or one per prompt;
- ``budget``: ``max_num_batched_tokens`` (0 or absent: vLLM's default); ``extra``: more connector config;
- ``forget``: reset vLLM's own prefix cache after each request (the next one can hit only LMCache); each run
  says whether vLLM did (``forgotten``);
- ``evict``: a list; each, after request ``after``, removes from every tier the state parts of prompt
  ``prompt``'s chunks ending at ``ends``;
- ``plant_early_states``: a planted fault, each state also stored as the state of the chunk before it.

It prints one JSON line: each request's tokens, top-5 logprobs, cached tokens and seconds, vLLM's block size, our
group plan, LMCache's chunk size, chunks stored and loaded, and the engines' health. MODE ``connector`` uses
LMCache with a persistent ``fs://`` store in STORE (or the ``remote_url`` in ``extra``); ``plain`` runs vLLM alone
with prefix caching off; ``align`` runs vLLM alone with its own prefix caching in align mode.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does

TOP_K = 5
MAX_MODEL_LEN = 10240


def engine_args(mode: str, store: str, job: dict) -> dict:
    args = {"skip_tokenizer_init": True, "enforce_eager": True, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4}
    if job.get("budget"):
        args["max_num_batched_tokens"] = job["budget"]
    if mode == "plain":
        return {**args, "enable_prefix_caching": False}
    if mode == "align":
        return {**args, "enable_prefix_caching": True, "mamba_cache_mode": "align"}
    extra = {"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.5,
             "lmcache.remote_url": f"fs://localhost:0{store}", "lmcache.remote_serde": "naive", **job.get("extra", {})}
    return {**args, "enable_prefix_caching": True, "mamba_cache_mode": "align",
            "kv_transfer_config": {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                                   "kv_connector_extra_config": extra}}


def plant_early_states(chunk: int) -> None:
    """Store each kept state a second time as the state of the chunk ending one chunk earlier (a wrong
    position): the oracle must catch the hits this makes."""
    from lmcache_platforms.integration.vllm import scheduler_side  # once the engine is up (import order)

    build = scheduler_side.build_request_meta

    def planted(*args, **kwargs):
        meta = build(*args, **kwargs)
        if meta is None or not meta.state_ends:
            return meta
        tables = [list(ids) for ids in meta.block_ids]
        early = tuple(c - chunk for c in meta.state_ends if c - chunk > meta.save_spec.skip_leading_tokens)
        for index in meta.snapshots:
            block_tokens = meta.block_sizes[index][1]
            for c in early:
                tables[index][c // block_tokens - 1] = tables[index][(c + chunk) // block_tokens - 1]
        meta.block_ids = tuple(tuple(ids) for ids in tables)
        meta.state_ends = tuple(sorted(early + meta.state_ends))
        return meta

    scheduler_side.build_request_meta = planted


def evict_states(impl, prompt: list[int], ends: list[int]) -> int:
    """Remove the state parts of ``prompt``'s chunks ending at ``ends`` from every tier; how many went."""
    from lmcache_platforms.connector.instance_adapter import with_tags
    from lmcache_platforms.connector.parts import part_configs
    from lmcache_platforms.integration.vllm.pending_writes import drain_writes
    from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG, request_scope

    engine = impl.lmcache_engine
    drain_writes(engine, timeout_s=60)  # remote puts are asynchronous: one still in flight would come back
    part = next(p for p in engine.gpu_connector.parts if p.snapshots)
    configs = part_configs(with_tags({SCOPE_TAG: request_scope(None, None)}, impl._key_tags), part)
    removed = 0
    for _, end, key in engine.token_database.process_tokens(tokens=prompt[: max(ends)], request_configs=configs):
        if end in ends:
            removed += engine.storage_manager.remove(key)
    return removed


def main(model: str, store: str, mode: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from lmcache_platforms.integration.vllm import health

    job = json.loads(sys.stdin.read())
    llm = LLM(model=model, **engine_args(mode, store, job))
    if job.get("plant_early_states"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        plant_early_states(get_kv_transfer_group().impl._lmcache_chunk_size)
    max_tokens = job.get("max_tokens", 6)
    runs = []
    for i, prompt in enumerate(job["prompts"]):
        limit = max_tokens[i] if isinstance(max_tokens, list) else max_tokens
        params = SamplingParams(max_tokens=limit, temperature=0, logprobs=TOP_K)
        started = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        runs.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens,
                     "seconds": time.perf_counter() - started,
                     "logprobs": [sorted((v.logprob, k) for k, v in step.items())[::-1][:TOP_K]
                                  for step in out.outputs[0].logprobs]})
        if job.get("forget"):
            runs[-1]["forgotten"] = llm.reset_prefix_cache()
        for evict in job.get("evict", []):
            if evict["after"] == i:
                from vllm.distributed.kv_transfer import get_kv_transfer_group

                runs[-1]["evicted"] = runs[-1].get("evicted", 0) + evict_states(
                    get_kv_transfer_group().impl, job["prompts"][evict["prompt"]], evict["ends"])
    result = {"runs": runs, "health": health.engine_health(),
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    if mode == "connector":
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        impl = get_kv_transfer_group().impl
        counters = impl.lmcache_engine.gpu_connector.binding.counters
        result.update(plan=impl.plan.describe(), hits_allowed=impl.plan.hits_allowed, why=impl.plan.why_no_hits(),
                      chunk_size=impl._lmcache_chunk_size, chunks_stored=counters.chunks_stored,
                      chunks_loaded=counters.chunks_loaded, layers_stored=counters.layers_stored,
                      layers_loaded=counters.layers_loaded)
    print(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:4])
