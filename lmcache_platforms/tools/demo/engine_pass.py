"""One in-process engine pass (vLLM's ``LLM`` class, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), run as its own process:
``python -m lmcache_platforms.tools.demo.engine_pass SPEC.json OUT.json``. The demo itself goes through ``vllm serve``
(``server_pass``); this is the other way users run vLLM, and the tests drive it with the same workload.

Each pass builds a fresh vLLM engine, serves the workload one request at a time (so each TTFT is one request's
own), writes what it saw to OUT.json and exits, so nothing of vLLM's own prefix cache or of an in-process
LMCache survives into the next pass: only what the configured LMCache storage kept. The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; the runner sets the environment), so the scheduler and the
worker hash tokens alike and the KV-cache groups can be read back from the scheduler.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from lmcache_platforms.tools import checksum_cost, step_cost
from lmcache_platforms.tools.demo.model import ModelSpec
from lmcache_platforms.tools.demo.runners import status_kib
from lmcache_platforms.tools.demo.scenario import BLOCK_SIZE, TOP_LOGITS
from lmcache_platforms.tools.demo.workload import Request, WorkloadSpec, warmup_request

HIT_COUNTERS = {"lmcache": "vllm:external_prefix_cache_hits", "vllm": "vllm:prefix_cache_hits"}


def pass_spec(model_dir: Path, model: ModelSpec, workload: WorkloadSpec, requests: list[Request],
              salt: str, kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    """What one in-process pass serves: the workload after a warm-up prompt as long as its longest request."""
    longest = max(len(r.tokens) for r in requests)
    warmup = warmup_request(longest, model.vocab_size, salt)
    return {
        "model_dir": str(model_dir),
        "block_size": BLOCK_SIZE,
        "max_model_len": model.max_model_len,
        "max_tokens": workload.max_tokens,
        "logprobs": TOP_LOGITS,
        "kv_transfer_config": kv_transfer_config,
        "warmup": asdict(warmup),
        "requests": [asdict(r) for r in requests],
    }


class Progress:
    """Appends one line per step to a file the parent process relays (our stdout is the engine's log)."""

    def __init__(self, path: str | None) -> None:
        self.path = path

    def __call__(self, message: str) -> None:
        if self.path:
            with open(self.path, "a") as f:
                f.write(message + "\n")


def _kv_groups(llm: Any) -> list[dict[str, Any]]:
    """The KV-cache groups the scheduler made: spec type, block size, sliding window, layer count."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    return [
        {
            "spec": type(group.kv_cache_spec).__name__,
            "block_size": group.kv_cache_spec.block_size,
            "sliding_window": getattr(group.kv_cache_spec, "sliding_window", None),
            "layers": len(group.layer_names),
        }
        for group in scheduler.kv_cache_config.kv_cache_groups
    ]


def metric_totals(llm: Any, counters: dict[str, str] = HIT_COUNTERS) -> dict[str, int]:
    """Totals so far of an in-process engine's counters (label -> metric name); by default the prefix-cache hit
    tokens from the connector (LMCache) and from vLLM's own cache."""
    totals = dict.fromkeys(counters, 0)
    for metric in llm.get_metrics():
        for source, name in counters.items():
            if metric.name == name:
                totals[source] += int(metric.value)
    return totals


def _top_logits(step: dict[int, Any]) -> list[list[float]]:
    """One generated position's top-k as ``[token, raw logit]`` pairs, best first."""
    ranked = sorted(step.items(), key=lambda item: (item[1].rank, item[0]))
    return [[token, float(entry.logprob)] for token, entry in ranked]


def _memory_mib(field: str) -> float | None:
    """``VmRSS`` (resident now) or ``VmHWM`` (the most resident since the last ``_reset_peak``) of this process,
    in MiB; None where ``/proc`` does not say."""
    kib = status_kib(field) if Path("/proc/self/status").exists() else None
    return None if kib is None else kib / 1024


def _reset_peak() -> None:
    """Start ``VmHWM`` again from what is resident now (Linux: ``clear_refs`` 5)."""
    clear = Path("/proc/self/clear_refs")
    if clear.exists():
        clear.write_text("5")


def _serve(llm: Any, request: dict[str, Any], params: Any, timed: bool = False) -> dict[str, Any]:
    """One request alone; ``timed``: with our connector's time in each of its methods (``tools/step_cost``)."""
    from vllm.inputs import TokensPrompt

    step_cost.TOTALS.reset()
    before = metric_totals(llm)
    t0 = time.perf_counter()
    (output,) = llm.generate([TokensPrompt(prompt_token_ids=request["tokens"])], params, use_tqdm=False)
    latency = time.perf_counter() - t0
    after = metric_totals(llm)
    completion = output.outputs[0]
    stats = output.metrics
    return {
        "name": request["name"],
        "prompt_tokens": len(request["tokens"]),
        "lmcache_hit_tokens": after["lmcache"] - before["lmcache"],
        "vllm_hit_tokens": after["vllm"] - before["vllm"],
        "ttft_s": stats.first_token_latency if stats is not None else None,
        # Where the TTFT went: waiting to be scheduled (connector lookup included), then prefill incl. loading.
        "queued_s": stats.scheduled_ts - stats.queued_ts if stats is not None else None,
        "prefill_s": stats.first_token_ts - stats.scheduled_ts if stats is not None else None,
        "latency_s": latency,
        "tokens": list(completion.token_ids),
        "top_logits": [_top_logits(step) for step in completion.logprobs or []],
        **({"connector": step_cost.TOTALS.as_dict()} if timed else {}),
    }


def _idle_decode(llm: Any, prompt: list[int], tokens: int) -> dict[str, Any]:
    """Decodes ``tokens`` tokens of a prompt shorter than a chunk (the connector has nothing to store or load),
    our connector's methods timed since the decode began (``tools/step_cost``)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, seed=0)
    step_cost.TOTALS.reset()
    started = time.perf_counter()
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return step_cost.per_step(step_cost.TOTALS.as_dict(), time.perf_counter() - started, tokens)


def run_pass(spec: dict[str, Any], progress: Progress) -> dict[str, Any]:
    """Serve ``spec['requests']`` through a fresh engine built from ``spec``; returns per-request results."""
    from vllm import LLM, SamplingParams

    progress("starting the engine")
    started = time.perf_counter()
    engine_args: dict[str, Any] = {
        "model": spec["model_dir"],
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "bfloat16",
        "block_size": spec["block_size"],
        "max_model_len": spec["max_model_len"],
        "max_num_batched_tokens": spec["max_model_len"],
        "max_num_seqs": 1,
        "disable_hybrid_kv_cache_manager": False,
        "disable_log_stats": False,
        "logprobs_mode": "raw_logits",
        "seed": 0,
        # Off where every hit must be LMCache's: the same prompt served twice in one engine (bench --engine).
        "enable_prefix_caching": spec.get("enable_prefix_caching", True),
    }
    if spec.get("kv_transfer_config"):
        engine_args["kv_transfer_config"] = spec["kv_transfer_config"]
    if spec.get("kv_events_endpoint"):  # vLLM's ZMQ publisher, as `--kv-events-config` sets it for a server
        from vllm.config import KVEventsConfig

        engine_args["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                         endpoint=spec["kv_events_endpoint"])
    if spec.get("checksum_cost"):
        checksum_cost.install()
    if spec.get("idle_steps"):
        step_cost.install()
    llm = LLM(**engine_args)
    result: dict[str, Any] = {"engine_start_s": time.perf_counter() - started, "kv_groups": _kv_groups(llm)}
    params = SamplingParams(
        temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True, logprobs=spec["logprobs"], seed=0
    )
    progress(f"engine ready in {result['engine_start_s']:.1f} s, {len(result['kv_groups'])} KV-cache groups; "
             "warm-up request")
    result["warmup"] = _serve(llm, spec["warmup"], params)
    # What the requests add to the memory the engine and a prefill of the longest prompt (the warm-up) hold.
    result["rss_after_warmup_mib"] = _memory_mib("VmRSS")
    _reset_peak()
    requests = []
    for request in spec["requests"]:
        requests.append(_serve(llm, request, params, timed=bool(spec.get("idle_steps"))))
        done = requests[-1]
        progress(f"{done['name']}: TTFT {done['ttft_s']:.3f} s (queued {done['queued_s']:.3f} s, prefill "
                 f"{done['prefill_s']:.3f} s), LMCache hit {done['lmcache_hit_tokens']}/{done['prompt_tokens']} "
                 "tokens")
    result["requests"] = requests
    result["peak_rss_requests_mib"] = _memory_mib("VmHWM")
    if spec.get("checksum_cost"):
        result["checksum_cost"] = checksum_cost.TOTALS.as_dict()
    if spec.get("idle_steps"):
        result["idle"] = _idle_decode(llm, spec["idle_prompt"], spec["idle_steps"])
        if result["idle"]["idle_steps"]:
            progress(f"idle decode: {result['idle']['idle_steps']} steps, connector "
                     f"{result['idle']['idle_connector_ms_per_step']:.3f} ms of {result['idle']['idle_step_ms']:.1f} "
                     "ms a step")
    if spec.get("memcpy_bytes"):
        from lmcache_platforms.tools.copy_reference import memcpy_seconds

        result["memcpy_s"] = memcpy_seconds(spec["memcpy_bytes"])
    progress("shutting the engine down")
    llm.llm_engine.engine_core.shutdown()
    return result


def main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    result = run_pass(spec, Progress(spec.get("progress_file")))
    out, partial = Path(argv[1]), Path(argv[1] + ".partial")
    partial.write_text(json.dumps(result))
    partial.replace(out)  # the runner treats the file's appearance as "finished": it must appear whole
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
