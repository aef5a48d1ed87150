"""Real vLLM (CPU, one process) running one prompt as a sequence of requests, each with its own ``cache_salt``
and LoRA adapter, through our connector (or without any connector, for the reference answers).

Arguments: the model folder and a JSON object: ``requests`` (a list of ``{"salt": str | null, "lora": bool,
"reset": "connector" | "vllm"}``, the last resetting vLLM's prefix cache first, asking the connector too or not),
``adapter`` (the adapter folder, enables LoRA), ``connector`` (default true), ``extra`` (more
``kv_connector_extra_config`` entries, e.g. a shared store), and the negative controls: ``unscoped`` ("salt" or
"lora": that part of the request's identity left out of our chunk keys), ``unidentified`` (true: one model
identity for every model). Prints one JSON line: per request its output tokens and the tokens our connector
loaded for it. Run as a module in a subprocess.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does

PROMPT = [(i * 37) % 2000 + 1 for i in range(300)]
CHUNK = 64


def _leave_out(part: str) -> None:
    """The negative control: keys that ignore the request's salt or adapter."""
    from lmcache_platforms.integration.vllm import request_scope

    scope = request_scope.request_scope
    if part == "salt":
        request_scope.request_scope = lambda lora, salt, generation="": scope(lora, None, generation)
    else:
        request_scope.request_scope = lambda lora, salt, generation="": scope(None, salt, generation)


def _one_identity() -> None:
    """The negative control: every model's chunk keys carry the same identity. Replaced before the engine impl
    imports it (importing the impl here, before vLLM builds its engine, makes vLLM's CPU kernel scan fail on a
    llvmlite object)."""
    from lmcache_platforms.integration.vllm import model_identity

    model_identity.model_identity = lambda model_config, revision="": model_identity.ModelIdentity("any", "-", "-")


def main(model: str, options: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    if options.get("unscoped"):
        _leave_out(options["unscoped"])
    if options.get("unidentified"):
        _one_identity()
    adapter = options.get("adapter")
    kwargs: dict = {}
    if adapter:
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=1)
    if options.get("connector", True):
        kwargs["kv_transfer_config"] = {
            "kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, "lmcache.local_cpu": True,
                                          "lmcache.max_local_cpu_size": 0.5, **options.get("extra", {})}}
    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=1024,
              enable_prefix_caching=False, **kwargs)
    params = SamplingParams(max_tokens=8, temperature=0)
    lora = LoRARequest("adapter", 1, adapter) if adapter else None
    results = []
    for request in options["requests"]:
        prompt = TokensPrompt(prompt_token_ids=PROMPT)
        if request.get("salt") is not None:
            prompt["cache_salt"] = request["salt"]
        if request.get("reset"):
            assert llm.reset_prefix_cache(reset_connector=request["reset"] == "connector")
        loaded_before = _chunks_loaded()
        output = llm.generate([prompt], params, lora_request=lora if request.get("lora") else None)[0]
        results.append({"output": list(output.outputs[0].token_ids),
                        "loaded_tokens": (_chunks_loaded() - loaded_before) * CHUNK})
    print(json.dumps(results))


def _chunks_loaded() -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    return int(get_kv_transfer_group().impl.lmcache_engine.gpu_connector.binding.counters.chunks_loaded)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))
