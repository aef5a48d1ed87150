"""Remote lookups with a time budget: LMCache 0.5.6's ``RemoteBackend.contains`` waits for ever.

Whether the remote store holds a chunk is asked on the worker's lookup server, for the scheduler, whose lookup
client gives up after LMCache's ``lookup_timeout_ms`` (3 s) and counts a miss. With a remote store that accepts
connections and never answers (a stuck Redis), every new request therefore stopped the whole engine for those
3 s, and the lookup server fell further behind with each one. Here an ask waits at most
``platforms.remote_lookup_timeout_s`` and counts as a miss past it.

A slow store is slow, not gone. Every LMCache client connects on its first command (redis-py opens its socket,
a Redis Cluster client first discovers which node holds which slots), and upstream makes a new connector when
the health monitor re-initializes a lost one (``RemoteBackend.connection`` becomes another object). So the
first ask on each connector gets ``platforms.remote_connect_timeout_s`` instead (once: a store that did not
answer it gets the usual budget next time). After a time-out, lookups skip the store (misses, no wait) until
the late answer arrives, then for twice its lateness (four times after a second time-out in a row, and so on),
never longer than ``platforms.remote_retry_s`` after the time-out; the next lookup then asks again. A store
that answered a second late is asked again two seconds later; one whose asks never end, once per
``remote_retry_s``. The log says once when lookups start skipping the store and once when it answers in time
again.

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

from lmcache_platforms.connector.remote_lookups import GUARD_ATTRIBUTE
from lmcache_platforms.log import init_logger
from lmcache_platforms.upstream_fixes.remote_close import backend_settings

logger = init_logger(__name__)

_guards_lock = threading.Lock()
BACKOFF_BASE = 2.0
"""After the n-th time-out in a row, the store is skipped for ``BACKOFF_BASE ** n`` times the late answer's
lateness (capped by ``remote_retry_s``)."""


class LookupGuard:
    """One remote backend's asking thread, time budgets and back-off; counts its time-outs and skipped asks for
    the connector statistics (``connector.remote_lookups``)."""

    def __init__(self, timeout_s: float, connect_s: float, retry_s: float, name: str) -> None:
        self.timeout_s, self.retry_s, self.connect_s = timeout_s, retry_s, max(connect_s, timeout_s)
        self.skip_until = 0.0
        self.strikes = 0
        self.timed_out = 0
        self.skipped = 0
        self._skipping = False
        self._connection: object | None = None
        self._state = threading.Lock()
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

    def budget(self, connection: object) -> float:
        """How long an ask on ``connection`` is waited for: the connect allowance for its first one."""
        with self._state:
            if connection is None or connection is self._connection:
                return self.timeout_s
            self._connection = connection
            return self.connect_s

    def ask(self, ask: Callable[[], Any], miss: Any, what: str, connection: object = None) -> Any:
        """``ask()``'s answer, or ``miss`` when the store is being skipped or does not answer in time."""
        if self.timeout_s <= 0 or threading.current_thread() is self.thread:
            return ask()  # no budget, or an ask made from inside another ask (batched -> single contains)
        if time.monotonic() < self.skip_until:
            with self._state:
                self.skipped += 1
            return miss
        budget = self.budget(connection)
        future: Future = Future()
        started = time.monotonic()
        self._asks.put((ask, future))
        try:
            answer = future.result(timeout=budget)
        except FutureTimeout:
            self._timed_out(future, started, budget, what)
            return miss
        self._in_time()
        return answer

    def _in_time(self) -> None:
        with self._state:
            self.strikes = 0
            back, self._skipping = self._skipping, False
        if back:
            logger.info("LMCache's remote store answers lookups in time again; lookups ask it again")

    def _timed_out(self, future: Future, started: float, budget: float, what: str) -> None:
        timed_out = time.monotonic()
        with self._state:
            self.strikes += 1
            self.timed_out += 1
            strikes = self.strikes
            self.skip_until = timed_out + self.retry_s
            newly, self._skipping = not self._skipping, True

        def late(_: Future) -> None:
            answered = time.monotonic()
            lateness = answered - started - budget
            with self._state:
                if strikes == self.strikes:  # no later time-out has set its own back-off since
                    self.skip_until = min(timed_out + self.retry_s, answered + BACKOFF_BASE ** strikes * lateness)

        if not future.cancel():  # running: its answer will say how late the store is
            future.add_done_callback(late)
        if newly:
            logger.warning("LMCache's remote store did not answer %s within %.3g s (%s); lookups count its "
                           "chunks as misses until it answers, then for %.3g times its lateness, at most %.3g s "
                           "(platforms.remote_retry_s)", what, budget,
                           "platforms.remote_lookup_timeout_s" if budget == self.timeout_s
                           else "platforms.remote_connect_timeout_s", BACKOFF_BASE ** strikes, self.retry_s)


def lookup_guard(backend: Any) -> LookupGuard:
    """The guard of ``backend`` (a ``RemoteBackend``), made on first use from its config and vLLM's keys."""
    guard = getattr(backend, GUARD_ATTRIBUTE, None)
    if guard is None:
        with _guards_lock:
            guard = getattr(backend, GUARD_ATTRIBUTE, None)
            if guard is None:
                settings = backend_settings(backend)
                guard = LookupGuard(settings.remote_lookup_timeout_s, settings.remote_connect_timeout_s,
                                    settings.remote_retry_s, type(backend).__name__)
                setattr(backend, GUARD_ATTRIBUTE, guard)
    return guard


def wrap_remote_contains(upstream: Callable[..., bool]) -> Callable[..., bool]:
    """Patch-catalog wrapper of ``RemoteBackend.contains``: upstream's answer within the time budget."""

    def contains(self: Any, key: Any, pin: bool = False) -> bool:
        return lookup_guard(self).ask(lambda: upstream(self, key, pin), False, "a lookup", self.connection)

    contains.upstream = upstream  # type: ignore[attr-defined]
    return contains


def wrap_remote_batched_contains(upstream: Callable[..., int]) -> Callable[..., int]:
    """Patch-catalog wrapper of ``RemoteBackend.batched_contains``: its prefix hit count within the budget."""

    def batched_contains(self: Any, keys: list[Any], pin: bool = False) -> int:
        return lookup_guard(self).ask(lambda: upstream(self, keys, pin), 0, f"a lookup of {len(keys)} chunks",
                                      self.connection)

    batched_contains.upstream = upstream  # type: ignore[attr-defined]
    return batched_contains
