"""One pass of the demo through vLLM's OpenAI-compatible server: start a fresh ``vllm serve``, send a warm-up
prompt and then the workload through the streaming client, stop the server, and read what its log says.

A fresh server per pass means nothing of vLLM's prefix cache or of an in-process LMCache survives into the
next pass: only what the configured LMCache storage kept. LMCache's remote writes are asynchronous; the engine
waits for them when it shuts down (``drained`` in its log), and a pass that did not stop cleanly is reported.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.runners import Resources, log_warnings
from lmcache_platforms.tools.demo.server import VllmServer
from lmcache_platforms.tools.demo.tokenizer import text_of
from lmcache_platforms.tools.demo.workload import Request

# vLLM's own line naming the KV-cache groups it made, and ours naming their spec classes.
_VLLM_GROUPS = re.compile(r"kv cache group sizes \(([^)]*)\)")
_OUR_GROUPS = re.compile(r"LMCache platforms engine impl \(scheduler\): saved \[([^\]]*)\]")
_GROUP_SPEC = re.compile(r"'group (\d+) \((\w+)\)'")


def kv_groups_from_log(text: str) -> list[dict[str, Any]]:
    """The KV-cache groups of a server's engine: vLLM's block sizes, with spec names where our connector ran."""
    sizes = _VLLM_GROUPS.findall(text)
    if not sizes:
        return []
    groups: list[dict[str, Any]] = [{"block_size": int(size), "spec": None}
                                    for size in sizes[-1].replace(",", " ").split()]
    ours = _OUR_GROUPS.findall(text)
    for index, spec in _GROUP_SPEC.findall(ours[-1] if ours else ""):
        if int(index) < len(groups):
            groups[int(index)]["spec"] = spec
    return groups


def serve_args(block_size: int, max_model_len: int) -> list[str]:
    """What every pass adds to ``vllm serve``: the same engine shape for all configurations, and raw bf16 logits
    in the replies (for the identity check)."""
    return ["--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--max-num-batched-tokens", str(max_model_len), "--enforce-eager", "--dtype", "bfloat16",
            "--seed", "0", "--logprobs-mode", "raw_logits",
            "--disable-uvicorn-access-log"]


@dataclass
class ServerPassRunner:
    """Runs passes of one model with the same server arguments, each in a fresh server."""

    workdir: Path
    resources: Resources
    model_dir: Path
    server_args: list[str]
    sampling: Sampling
    progress: Callable[[str], None]
    start_timeout_s: float = 600.0

    def run(self, label: str, kv_transfer_config: dict[str, Any] | None, requests: list[Request],
            warmup: Request | None, extra_env: dict[str, str] | None = None) -> dict[str, Any]:
        """Serve ``requests`` (after ``warmup``) through a fresh server; the pass's result dict."""
        log_path = self.workdir / f"{label}.log"
        server = VllmServer.for_model(self.model_dir, kv_transfer_config, self.server_args, log_path,
                                      self.resources, extra_env)
        server.start_timeout_s = self.start_timeout_s
        self.progress(f"  [{label}] starting vllm serve on port {server.port}")
        with server:
            self.progress(f"  [{label}] server ready in {server.started_s:.1f} s")
            prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in ([warmup] if warmup else [])]
            warm_up = run_requests(server.base_url, prompts, self.sampling) if prompts else []
            results = []
            for request in requests:
                (done,) = run_requests(server.base_url, [(request.name, text_of(request.tokens),
                                                          len(request.tokens))], self.sampling)
                results.append(done)
                self.progress(f"  [{label}] {done['name']}: TTFT {done['ttft_s']:.3f} s, LMCache hit "
                              f"{done['lmcache_hit_tokens']}/{done['prompt_tokens']} tokens, vLLM prefix hit "
                              f"{done['vllm_hit_tokens']}")
        log = log_path.read_text(errors="replace")
        warnings = log_warnings(log_path)
        if not server.stopped_in_time:
            warnings.append(f"pass {label}: vllm serve did not stop within {server.stop_timeout_s:.0f} s of "
                            "SIGINT (hung at exit); it was killed")
        return {
            "engine_start_s": server.started_s,
            "kv_groups": kv_groups_from_log(log),
            "warmup": warm_up[0] if warm_up else None,
            "requests": results,
            "exit_code": server.exit_code,
            "warnings": warnings,
            "log": str(log_path),
        }
