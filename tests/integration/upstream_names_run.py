"""One in-process vLLM engine (CPU) serving a prompt twice through the connector name given, with the package
installed as users have it (the ``vllm.general_plugins`` entry point activates it).

Prints one JSON line: whether vLLM kept its hybrid KV-cache manager, the chunks our GPU connector stored and
loaded, and each pass's tokens with their top-5 logprobs. ``--corrupt`` overwrites every chunk in LMCache's
local CPU tier between the passes (the negative control of the identical-output oracle); ``--fp8`` makes vLLM
keep its KV cache in fp8 (``kv_cache_dtype="fp8"``). Run in a subprocess:
``python -m tests.integration.upstream_names_run MODEL CONNECTOR [--corrupt] [--fp8]`` (``none``: no connector;
``ExampleConnector``: vLLM's own example connector, storing in a temporary folder).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

CHUNK = 64
PROMPT = [(i * 37) % 2000 + 1 for i in range(300)]
MODULE_PATHS = {"LMCacheConnectorV1Dynamic": "lmcache.integration.vllm.lmcache_connector_v1"}


def transfer_config(connector: str) -> dict | None:
    if connector == "none":
        return None
    if connector == "ExampleConnector":
        import tempfile

        return {"kv_connector": connector, "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": tempfile.mkdtemp()}}
    config = {"kv_connector": connector, "kv_role": "kv_both",
              "kv_connector_extra_config": {"lmcache.chunk_size": CHUNK, "lmcache.local_cpu": True,
                                            "lmcache.max_local_cpu_size": 0.5}}
    if connector in MODULE_PATHS:
        config["kv_connector_module_path"] = MODULE_PATHS[connector]
    return config


def _impl(transfer_group):
    """Our engine impl inside whichever connector class vLLM built."""
    return getattr(transfer_group, "impl", None) or transfer_group._lmcache_engine


def _corrupt(impl) -> int:
    """Overwrite every cached chunk's KV bytes and seal it again, as a bug on our own store path would: its
    checksum then holds, so only the answers can show the damage."""
    import torch

    from lmcache_platforms.connector import checksum

    payload = impl.lmcache_engine.gpu_connector.fmt.payload_bytes
    backend = impl.lmcache_engine.storage_manager.storage_backends["LocalCPUBackend"]
    for obj in backend.hot_cache.values():
        flat = obj.tensor.view(torch.uint8).view(-1)
        flat[:payload].fill_(0x3C)
        checksum.seal([flat], payload)
    return len(backend.hot_cache)


def main(model: str, connector: str, corrupt: bool, fp8: bool) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=1024,
              enable_prefix_caching=False, kv_transfer_config=transfer_config(connector),
              kv_cache_dtype="fp8" if fp8 else "auto")
    params = SamplingParams(max_tokens=8, temperature=0, logprobs=5)
    passes, corrupted = [], None
    for index in range(2):
        if index == 1 and corrupt:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            corrupted = _corrupt(_impl(get_kv_transfer_group()))
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params)[0].outputs[0]
        passes.append({"tokens": list(out.token_ids),
                       "logprobs": [sorted((t, lp.logprob) for t, lp in step.items()) for step in out.logprobs]})
    result = {"hma": not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
              "passes": passes, "corrupted": corrupted, "lmcache_imported": "lmcache" in sys.modules}
    if connector not in ("none", "ExampleConnector"):
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        impl = _impl(get_kv_transfer_group())
        counters = impl.lmcache_engine.gpu_connector.binding.counters
        result.update(wrapper=impl.contract.wrapper, groups=len(impl.plan.groups), key_tags=impl._key_tags,
                      chunks_stored=counters.chunks_stored, chunks_loaded=counters.chunks_loaded)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], "--corrupt" in sys.argv[3:], "--fp8" in sys.argv[3:])
