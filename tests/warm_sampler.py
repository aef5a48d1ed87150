"""vLLM's compiled sampler op, made ready once in a fork server instead of once per engine.

When a request asks for logprobs, vLLM ranks the sampled tokens with ``batched_count_greater_than``, a function
under ``torch.compile``: its first call in a process spends 4-5 s of CPU (importing torch's compiler, tracing,
lowering, loading the kernel), even with the kernel cached on disk, in every engine the suite builds. Each fork
server (``tests/fork_server.py``) calls it once before it forks. torch guards compiled code on the thread count,
so a child on its own count compiles the op again, from what the server loaded: ~0.1 s with the kernel in the
disk cache, ~1.4 s without. The warm-up compiles one kernel for every vocabulary size (its second dimension
marked dynamic): on an empty disk cache, as on a CI machine, that C++ compile is most of its ~14 s.
It adds ``vllm.v1.sample.ops.logprobs`` (and torch's compiler) to what the servers preloaded; nothing of LMCache
or of vLLM's KV-transfer package comes with it (the servers check).

GNU OpenMP cannot run a parallel region in a forked child once the parent ran one: the child hangs. So the
warm-up runs the op on one thread (``threads``: another count is for the test that shows the hang).
"""

from __future__ import annotations


def warm(threads: int = 1) -> None:
    import torch
    import torch._inductor.config as inductor
    from vllm.v1.sample.ops.logprobs import batched_count_greater_than

    own_threads, compile_threads = torch.get_num_threads(), inductor.compile_threads
    torch.set_num_threads(threads)
    inductor.compile_threads = 1  # no compile-worker pool for the children to inherit
    try:
        logprobs = torch.zeros(2, 2048)
        ranked = logprobs[:, :1].clone()
        torch._dynamo.decorators.mark_unbacked(logprobs, 0)  # as vLLM's sampler marks them
        torch._dynamo.decorators.mark_unbacked(ranked, 0)
        torch._dynamo.decorators.mark_dynamic(logprobs, 1)  # one kernel for every vocabulary size
        batched_count_greater_than(logprobs, ranked)
    finally:
        torch.set_num_threads(own_threads)
        inductor.compile_threads = compile_threads
