"""One fuzz pass: a fresh in-process vLLM engine serving a workload, run as its own process
(``python -m tests.fuzz.engine SPEC.json OUT.json``). The same script serves both sides of a comparison; the
reference side differs only in asking LMCache to store nothing (``lmcache.skip_save`` on every request), so
both engines have the same connector, threads and scheduling, and only loads can make them differ.

A planted fault (``spec["plant"]``, negative controls only) is installed before the engine starts: the engine
runs in this process, so the worker sees it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# Both sides compute on the same core with one thread: vLLM's CPU worker binds two cores with a KV connector
# and one without, and two threads reduce in another order than one.
os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "0"

import lmcache_platforms  # noqa: F401 - activation, as vLLM's plugin entry point does
from lmcache_platforms.tools.demo.engine_pass import HIT_COUNTERS, metric_totals
from tests.fuzz import plants

MODULE_PATHS = {"LMCacheConnectorV1Dynamic": "lmcache.integration.vllm.lmcache_connector_v1"}
HIT_METRICS = {**HIT_COUNTERS, "preemptions": "vllm:num_preemptions"}


def _transfer_config(spec: dict[str, Any]) -> dict[str, Any]:
    connector = spec["connector"]
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": "kv_both",
                              "kv_connector_extra_config": dict(spec["extra_config"])}
    if connector in MODULE_PATHS:
        config["kv_connector_module_path"] = MODULE_PATHS[connector]
    return config


def _answer(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {"tokens": list(completion.token_ids),
            "logprobs": [sorted([t, lp.logprob] for t, lp in step.items()) for step in completion.logprobs or []]}


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plants.install(spec.get("plant"))
    engine = dict(spec["engine"])
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, enforce_eager=True, seed=0,
              logprobs_mode="raw_logits", disable_log_stats=False, kv_transfer_config=_transfer_config(spec),
              **engine)
    extra = {"kv_transfer_params": {"lmcache.skip_save": True}} if spec["reference"] else None
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=3,
                            extra_args=extra)
    hma = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    answers: list[dict[str, Any]] = []
    for batch in spec["batches"]:
        before = metric_totals(llm, HIT_METRICS)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=tokens) for tokens in batch], params, use_tqdm=False)
        after = metric_totals(llm, HIT_METRICS)
        for output in outputs:
            answers.append(_answer(output))
        answers[-1]["batch_hits"] = {k: after[k] - before[k] for k in after}
    llm.llm_engine.engine_core.shutdown()
    return {"hma": hma, "answers": answers}


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
