"""Plain copies of a byte count, timed the way every transfer figure of ours is compared: the reference a
speed is divided by (``bench`` on a layout, and ``bench --engine`` inside a real engine)."""

from __future__ import annotations

import time
from collections.abc import Callable

# Pause before each timed work: torch's OpenMP threads keep spinning for milliseconds after a parallel
# region, and on a small machine they would steal the CPU from whatever is timed next.
SETTLE_SECONDS = 0.005


def best_of_rounds(works: dict[str, Callable[[], object]], sync: Callable[[], None], repeats: int) -> dict:
    """Best seconds of each work, timed in interleaved rounds after one warm-up round.

    Interleaving puts every contender through the same moments of a shared, noisy machine, so the ratios
    compare like with like.
    """
    best = dict.fromkeys(works, float("inf"))
    for round_index in range(repeats + 1):
        for name, work in works.items():
            sync()
            time.sleep(SETTLE_SECONDS)
            start = time.perf_counter()
            work()
            sync()
            if round_index:
                best[name] = min(best[name], time.perf_counter() - start)
    return best


def graph_seconds(works: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Seconds of GPU time alone for each work on CUDA: captured once in a CUDA graph, replayed ``repeats`` times
    between two events. Launching from Python costs tens of microseconds per launch, more than a small chunk
    takes to move; replaying leaves the host out, so this is what the kernels cost the GPU next to a copy."""
    import torch

    seconds = {}
    for name, work in works.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # CUDA graphs want the work run once off the default stream first
            work()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            work()
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        seconds[name] = start.elapsed_time(end) / 1e3 / repeats
    return seconds


def copiers(num_bytes: int, device) -> dict[str, tuple[Callable[[], object], float]]:
    """Plain copies of ``num_bytes`` between two contiguous uint8 tensors: name -> (work, seconds factor).

    ``copy_`` is torch's (its intra-op threads). On CPU, a contiguous copy through the native library's
    thread pool (same thread count) is timed too, over a size rounded up to 1024 equal pieces (the factor
    scales its time back to ``num_bytes``): on a busy machine torch's OpenMP copy waits for its second
    thread and would flatter every ratio; the faster of the two is the memcpy reference.
    """
    import torch

    src = torch.randint(0, 256, (num_bytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copies: dict[str, tuple[Callable[[], object], float]] = {"copy_": (lambda: dst.copy_(src), 1.0)}
    if device.type != "cpu":
        return copies
    from lmcache_platforms.kernels.contract import Direction
    from lmcache_platforms.kernels.registry import get_backend
    from lmcache_platforms.layout.plane import Plane, PlaneGeometry

    native = get_backend("cpu")
    if not native.availability()[0]:
        return copies
    pieces, piece = 1024, -(-num_bytes // 1024 // 64) * 64
    source = torch.randint(0, 256, (pieces * piece,), dtype=torch.uint8)
    target = torch.empty_like(source)
    plane = Plane("copy", "source", 0, torch.uint8, PlaneGeometry(pieces, piece, 1, piece, 1, piece, piece), 0,
                  torch.empty(0, dtype=torch.uint8).set_(source.untyped_storage()))
    slots = torch.arange(pieces)
    copies["pool"] = (lambda: native.transfer((plane,), slots, target, Direction.STORE), num_bytes / source.numel())
    return copies


def best_copy(best: dict, copies: dict) -> dict:
    """Seconds of each plain copy for the measured byte count, and the fastest as ``copy``."""
    seconds = {name: best[name] * factor for name, (_, factor) in copies.items()}
    return {**seconds, "copy": min(seconds.values())}


def memcpy_seconds(num_bytes: int, repeats: int = 5) -> float:
    """Seconds of the fastest plain host copy of ``num_bytes`` (best of ``repeats`` rounds)."""
    import torch

    copies = copiers(num_bytes, torch.device("cpu"))
    best = best_of_rounds({name: work for name, (work, _) in copies.items()}, lambda: None, repeats)
    return best_copy(best, copies)["copy"]
