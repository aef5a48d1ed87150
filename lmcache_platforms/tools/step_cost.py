"""``bench --engine --idle-steps N``: what our connector costs an engine step when it has nothing to move.

Comparing an engine's time per output token with and without a connector compares more than the connector:
vLLM's CPU worker binds one core without one and two with any, and short decode runs on two shared cores differ
by tens of percent from run to run. Instead, in the engine pass (installed before the engine starts, measurement
only), every method vLLM calls on our connector (scheduler and worker side alike: the engine pass runs both in
one process) is timed call by call, outermost calls only. After the measured prompts the pass decodes one short
prompt (fewer tokens than a chunk: nothing to store, no hit to load) for N tokens; the connector's seconds over
those steps, per step (one ``build_connector_meta`` each), against the step's own wall time, is the figure.

This wraps our own class for one process, not upstream's, so it is not in the patch registry.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

# Called once per engine, not per step.
_LIFECYCLE = frozenset({"register_kv_caches", "unregister_kv_caches", "restore_kv_caches", "shutdown",
                        "reset_cache"})
# One call per scheduler step: the step count.
STEP_METHOD = "build_connector_meta"


class Totals:
    """Seconds and calls per connector method since the last ``reset``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._inside = threading.local()

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()

    def as_dict(self) -> dict[str, Any]:
        return {"seconds": dict(self.seconds), "calls": dict(self.calls)}


TOTALS = Totals()


def _timed(name: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        inside = TOTALS._inside
        if getattr(inside, "depth", 0):  # a connector method calling another: counted once, by the outer one
            return function(*args, **kwargs)
        inside.depth = 1
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            inside.depth = 0
            TOTALS.seconds[name] = TOTALS.seconds.get(name, 0.0) + time.perf_counter() - started
            TOTALS.calls[name] = TOTALS.calls.get(name, 0) + 1

    return timed


def timed_methods(cls: type) -> list[str]:
    """The methods of ``cls`` (its own, not inherited) vLLM calls while serving: plain functions, not the
    lifecycle ones."""
    return sorted(name for name, value in vars(cls).items()
                  if callable(value) and not isinstance(value, (classmethod, staticmethod, type))
                  and not name.startswith("_") and name not in _LIFECYCLE)


def install(setter: Callable[[object, str, Any], None] = setattr) -> None:
    """Times every serving method of our connector into ``TOTALS``: call once, before the engine starts.
    ``setter`` replaces each attribute (a test passes one that puts them back)."""
    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector

    for name in timed_methods(LMCachePlatformsConnector):
        setter(LMCachePlatformsConnector, name, _timed(name, getattr(LMCachePlatformsConnector, name)))


def per_step(totals: dict[str, Any], wall_s: float, tokens: int) -> dict[str, Any]:
    """The figure of a decode of ``tokens`` tokens that took ``wall_s``: steps (``STEP_METHOD`` calls), the
    connector's ms per step, the step's ms (wall over steps), the connector's share of it, and the ms per step of
    each method that took any time (``idle_ms_per_step_<method>``). Only ``idle_steps`` without a step."""
    steps = totals["calls"].get(STEP_METHOD, 0)
    if not steps:
        return {"idle_steps": 0}
    spent = sum(totals["seconds"].values())
    return {
        "idle_steps": steps,
        "idle_tokens": tokens,
        "idle_connector_ms_per_step": spent / steps * 1e3,
        "idle_step_ms": wall_s / steps * 1e3,
        "idle_connector_share": spent / wall_s if wall_s > 0 else None,
        **{f"idle_ms_per_step_{name}": seconds / steps * 1e3
           for name, seconds in sorted(totals["seconds"].items()) if seconds > 0},
    }
