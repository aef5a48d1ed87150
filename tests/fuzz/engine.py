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
    config: dict[str, Any] = {"kv_connector": connector, "kv_role": spec.get("role", "kv_both"),
                              "kv_connector_extra_config": dict(spec["extra_config"])}
    if connector in MODULE_PATHS:
        config["kv_connector_module_path"] = MODULE_PATHS[connector]
    return config


def _answer(output: Any) -> dict[str, Any]:
    completion = output.outputs[0]
    return {"tokens": list(completion.token_ids),
            "logprobs": [sorted([t, lp.logprob] for t, lp in step.items()) for step in completion.logprobs or []]}


def pinned_objects() -> int:
    """Objects LMCache's CPU tier still holds pinned (for a load that never came): none once every request of
    the pass has finished, preempted and aborted ones included."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    count = 0
    for engine in LMCacheEngineBuilder._instances.values():
        backend = engine.storage_manager.local_cpu_backend if engine.storage_manager else None
        if backend is not None:
            with backend.cpu_lock:
                count += sum(obj.meta.pin_count > 0 for obj in backend.hot_cache.values())
    return count


def _looked_up_while_waiting(engine: Any, request_id: str) -> bool:
    """Whether LMCache holds pins of the request's lookup while vLLM's scheduler still has it waiting for blocks
    (looked up, then not admitted: its next step does not fit the cache)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from vllm.v1.request import RequestStatus

    request = engine.engine_core.engine_core.scheduler.requests.get(request_id)
    if request is None or request.status != RequestStatus.WAITING:
        return False
    return any(key.startswith(request_id) for lmcache in LMCacheEngineBuilder._instances.values()
               for key in lmcache.lookup_pins)


def serve(engine: Any, number: int, batch: list[list[int]], params: Any,
          abort_last: str | None) -> tuple[list[Any], int]:
    """The batch's requests added together and stepped to the end, and how many were aborted while waiting. With
    ``abort_last``, the batch's last request is aborted by its client: ``"mid-load"``, after the engine's first
    step (its hit's load then in flight or done); ``"waiting"``, after the first step that looked it up but left
    it waiting for blocks (its lookup's pins held for a load that never comes). Its answer is None."""
    from vllm.inputs import TokensPrompt

    ids = [f"{number}-{i}" for i in range(len(batch))]
    internal = [engine.add_request(request_id, TokensPrompt(prompt_token_ids=tokens), params)
                for request_id, tokens in zip(ids, batch, strict=True)]
    finished: dict[str, Any] = {}
    steps = aborted_waiting = 0
    pending = abort_last
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
        steps += 1
        due = steps == 1 if pending == "mid-load" else (
            pending == "waiting" and _looked_up_while_waiting(engine, internal[-1]))
        if due:
            engine.abort_request([ids[-1]])
            aborted_waiting += pending == "waiting"
            pending = None
    answers = [None if abort_last and request_id == ids[-1] else finished[request_id] for request_id in ids]
    return answers, aborted_waiting


def run(spec: dict[str, Any]) -> dict[str, Any]:
    from vllm import LLM, SamplingParams

    plants.install(spec.get("plant"), engine_up=False)
    engine = dict(spec["engine"])
    llm = LLM(model=spec["model_dir"], skip_tokenizer_init=True, enforce_eager=True, seed=0,
              logprobs_mode="raw_logits", disable_log_stats=False, kv_transfer_config=_transfer_config(spec),
              **engine)
    plants.install(spec.get("plant"), engine_up=True)
    extra = {"kv_transfer_params": {"lmcache.skip_save": True}} if spec["reference"] else None
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=3,
                            extra_args=extra)
    hma = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
    answers: list[dict[str, Any]] = []
    aborted_waiting = 0
    for number, batch in enumerate(spec["batches"]):
        before = metric_totals(llm, HIT_METRICS)
        abort = "mid-load" if number in spec.get("aborted", ()) else (
            "waiting" if number in spec.get("aborted_waiting", ()) else None)
        outputs, waiting = serve(llm.llm_engine, number, batch, params, abort)
        aborted_waiting += waiting
        after = metric_totals(llm, HIT_METRICS)
        answers += [_answer(output) if output else {"tokens": [], "logprobs": []} for output in outputs]
        answers[-1]["batch_hits"] = {k: after[k] - before[k] for k in after}
        if spec.get("forget"):
            llm.reset_prefix_cache()
    pinned = pinned_objects()
    llm.llm_engine.engine_core.shutdown()
    return {"hma": hma, "answers": answers, "pinned": pinned, "aborted_waiting": aborted_waiting,
            "chunk_size": _chunk_size_in_effect()}


def _chunk_size_in_effect() -> int:
    """LMCache's chunk size as our impl set it: a recurrent hybrid's states are kept once per vLLM block, so a
    chunk size that is not a multiple of it is raised to one (vLLM's block in align mode grows with an fp8 cache:
    384 tokens for the Qwen3-Next-like model, whose case drew 256)."""
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config

    return int(lmcache_get_or_create_config().chunk_size)


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(spec)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
