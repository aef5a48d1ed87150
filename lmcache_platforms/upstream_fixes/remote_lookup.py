"""Remote lookups with a time budget: LMCache 0.5.6's ``RemoteBackend.contains`` waits for ever.

Whether the remote store holds a chunk is asked on the worker's lookup server, for the scheduler, whose lookup
client gives up after LMCache's ``lookup_timeout_ms`` (3 s) and counts a miss. With a remote store that accepts
connections and never answers (a stuck Redis), every new request therefore stopped the whole engine for those
3 s, and the lookup server fell further behind with each one. Here an ask waits at most
``platforms.remote_lookup_timeout_s`` and counts as a miss past it; lookups then skip the remote store (misses)
for ``platforms.remote_retry_s`` before asking it again, so a dead store costs one time-out per retry period,
not one per request.

An ask that timed out keeps running on the backend's one asking thread until the store or its client gives up
(redis-py: ``socket_timeout``, 5 s by default, settable in the URL as ``?socket_timeout=S``): a store that never
answers holds that one daemon thread, not one per lookup, and never blocks interpreter exit.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from lmcache_platforms.log import init_logger
from lmcache_platforms.upstream_fixes.remote_close import backend_settings

logger = init_logger(__name__)

_GUARD = "_lmcache_platforms_lookup_guard"
_guards_lock = threading.Lock()


class LookupGuard:
    """One remote backend's asking thread, time budget and back-off."""

    def __init__(self, timeout_s: float, retry_s: float, name: str) -> None:
        self.timeout_s, self.retry_s = timeout_s, retry_s
        self.skip_until = 0.0
        self._asks: queue.SimpleQueue[tuple[Callable[[], Any], Future]] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, daemon=True, name=f"lmcache-platforms-ask-{name}")
        self.thread.start()

    def _serve(self) -> None:
        while True:
            ask, future = self._asks.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(ask())
                except Exception as exc:  # noqa: BLE001 - handed to the waiting caller, raised there as upstream's
                    future.set_exception(exc)

    def ask(self, ask: Callable[[], Any], miss: Any, what: str) -> Any:
        """``ask()``'s answer, or ``miss`` when the store is being skipped or does not answer in time."""
        if self.timeout_s <= 0 or threading.current_thread() is self.thread:
            return ask()  # no budget, or an ask made from inside another ask (batched -> single contains)
        if time.monotonic() < self.skip_until:
            return miss
        future: Future = Future()
        self._asks.put((ask, future))
        try:
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            future.cancel()
            self.skip_until = time.monotonic() + self.retry_s
            logger.warning("LMCache's remote store did not answer %s within %.3g s (platforms.remote_lookup_timeout_s)"
                           "; lookups count its chunks as misses for the next %.3g s (platforms.remote_retry_s)",
                           what, self.timeout_s, self.retry_s)
            return miss


def lookup_guard(backend: Any) -> LookupGuard:
    """The guard of ``backend`` (a ``RemoteBackend``), made on first use from its config and vLLM's keys."""
    guard = getattr(backend, _GUARD, None)
    if guard is None:
        with _guards_lock:
            guard = getattr(backend, _GUARD, None)
            if guard is None:
                settings = backend_settings(backend)
                guard = LookupGuard(settings.remote_lookup_timeout_s, settings.remote_retry_s,
                                    type(backend).__name__)
                setattr(backend, _GUARD, guard)
    return guard


def wrap_remote_contains(upstream: Callable[..., bool]) -> Callable[..., bool]:
    """Patch-catalog wrapper of ``RemoteBackend.contains``: upstream's answer within the time budget."""

    def contains(self: Any, key: Any, pin: bool = False) -> bool:
        return lookup_guard(self).ask(lambda: upstream(self, key, pin), False, "a lookup")

    contains.upstream = upstream  # type: ignore[attr-defined]
    return contains


def wrap_remote_batched_contains(upstream: Callable[..., int]) -> Callable[..., int]:
    """Patch-catalog wrapper of ``RemoteBackend.batched_contains``: its prefix hit count within the budget."""

    def batched_contains(self: Any, keys: list[Any], pin: bool = False) -> int:
        return lookup_guard(self).ask(lambda: upstream(self, keys, pin), 0, f"a lookup of {len(keys)} chunks")

    batched_contains.upstream = upstream  # type: ignore[attr-defined]
    return batched_contains
