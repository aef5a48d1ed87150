"""Loads that run while their request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` state, reported per request.

vLLM 0.32+ lets a connector answer a lookup with ``(n, True)``: the request's blocks are allocated but it is
not scheduled until the worker reports the load in ``finished_recving``; a load that came back short is
also put in ``failed_recving``, and the scheduler then recomputes that request (``kv_load_failure_policy``
``recompute``) or fails that request alone (``fail``). That is the only per-request failure report vLLM
accepts for models with several KV-cache groups, so a short load never has to stop the engine.

A load runs on one loader thread, so that a backend that never answers cannot hold the engine for longer
than the deadline: in the ``async`` load mode the step returns at once and other requests' forwards go on
meanwhile; in ``sync`` the step waits for the load (``wait=True``), at most until its deadline. Either way
its outcome is reported at the next ``poll``. A load that outlives its deadline is reported failed and
*cancelled*: its ``LoadGuard`` then refuses every later write, so a backend that answers late can never
write into blocks vLLM has given back for recomputation. ``start`` is the same for a load whose outcome the
step itself needs (vLLM's classic same-step load, or one layer by layer).
``load`` returns True only when every expected token arrived and the guard saw no failure.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

T = TypeVar("T")


class LoadGuard:
    """One load's KV-cache writes, serialised with its cancellation. ``run`` never raises: a write that
    fails (a kernel error) or comes after ``cancel`` is recorded and skipped, so LMCache's retrieve still
    returns normally and releases its references to the chunks; the owner reads ``failure`` afterwards."""

    def __init__(self, req_id: str) -> None:
        self.req_id = req_id
        self._lock = threading.Lock()
        self.cancelled: str | None = None
        self.write_error: str | None = None
        self.cause: str | None = None
        """Why the load failed, for the statistics (``stats.FAILURE_CAUSES``); the first cause found wins."""

    def failed(self, cause: str) -> None:
        self.cause = self.cause or cause

    def cancel(self, why: str, cause: str = "timeout") -> None:
        """Waits for a write in progress to finish, then refuses every later one."""
        with self._lock:
            self.cancelled = why
            self.failed(cause)

    def run(self, write: Callable[[], None]) -> None:
        with self._lock:
            if self.cancelled is not None:
                logger.warning("request %s: late LMCache load write refused: the load was cancelled (%s)",
                               self.req_id, self.cancelled)
                return
            try:
                write()
            except Exception as exc:
                logger.exception("request %s: writing loaded KV into vLLM's cache failed", self.req_id)
                self.write_error = f"{type(exc).__name__}: {exc}"
                self.failed("error")

    @property
    def failure(self) -> str | None:
        """Why the load's rows cannot be trusted, or None."""
        return self.cancelled or self.write_error


@dataclass
class _Load:
    guard: LoadGuard
    deadline: float
    future: Future | None = None
    outcome: bool | None = None


def _remaining(deadline: float) -> float | None:
    """Seconds left until ``deadline`` (None: no deadline), as ``Future.result`` takes them."""
    return None if deadline == float("inf") else max(0.0, deadline - time.monotonic())


@dataclass
class StartedLoad(Generic[T]):
    """A load the step itself needs the outcome of, running on the loader thread until its deadline."""

    req_id: str
    guard: LoadGuard
    future: Future[T]
    deadline: float
    timeout_s: float

    def give_up(self) -> None:
        """Past its deadline: cancelled, so a late answer writes nothing."""
        if self.guard.cancelled is not None:
            return
        self.guard.cancel(f"no answer within load_timeout_s={self.timeout_s:g}")
        logger.error("request %s: LMCache load still running after %.3g s; its blocks are reported failed and "
                     "its late writes refused (platforms.load_timeout_s)", self.req_id, self.timeout_s)

    def result(self, on_failure: T) -> T:
        """The load's result once it ended; ``on_failure`` when it raised or outlived the deadline."""
        try:
            return self.future.result(timeout=_remaining(self.deadline))
        except FutureTimeout:
            self.give_up()
        except Exception:
            logger.exception("request %s: loading from LMCache failed", self.req_id)
            self.guard.failed("error")
        return on_failure


@dataclass
class LoadResults:
    """What ``poll`` hands to vLLM: every request whose load ended, and those of them that failed (with why)."""

    finished: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    causes: dict[str, str] = field(default_factory=dict)


class AsyncLoads:
    """Runs ``load(req_id, guard) -> bool`` per request (True: every expected token arrived) and reports
    each outcome once. An exception from a load is a failed load, logged with its traceback."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._loads: dict[str, _Load] = {}
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="lmcache-platforms-load")

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout_s if self.timeout_s > 0 else float("inf")

    def submit(self, req_id: str, load: Callable[[str, LoadGuard], bool], wait: bool = False) -> None:
        """Start ``load`` on the loader thread; with ``wait``, return once it ended or its deadline passed."""
        guard = LoadGuard(req_id)
        entry = _Load(guard, self._deadline())
        with self._lock:
            if req_id in self._loads:
                raise RuntimeError(f"request {req_id}: a load is already in flight")
            self._loads[req_id] = entry
        entry.future = self._executor.submit(self._run, req_id, guard, load)
        if wait:
            with contextlib.suppress(FutureTimeout):  # past the deadline: the next poll cancels and reports it
                entry.future.result(timeout=_remaining(entry.deadline))

    def start(self, req_id: str, load: Callable[[LoadGuard], T]) -> StartedLoad[T]:
        """Start ``load`` on the loader thread; its outcome is read with ``StartedLoad.result``."""
        guard = LoadGuard(req_id)
        return StartedLoad(req_id, guard, self._executor.submit(load, guard), self._deadline(), self.timeout_s)

    def fail(self, req_id: str) -> None:
        """Report ``req_id`` failed at the next poll without running anything (e.g. sleep mode)."""
        guard = LoadGuard(req_id)
        guard.failed("unregistered")
        with self._lock:
            self._loads[req_id] = _Load(guard, 0.0, outcome=False)

    @staticmethod
    def _run(req_id: str, guard: LoadGuard, load: Callable[[str, LoadGuard], bool]) -> bool:
        if guard.cancelled is not None:
            return False
        try:
            return load(req_id, guard)
        except Exception:
            logger.exception("request %s: loading from LMCache failed; vLLM will recompute or fail the request",
                             req_id)
            guard.failed("error")
        return False

    def poll(self) -> LoadResults:
        """Loads that ended since the last poll (a load past its deadline is cancelled and counts as failed)."""
        results = LoadResults()
        now = time.monotonic()
        with self._lock:
            for req_id, entry in list(self._loads.items()):
                if entry.outcome is None and entry.future is not None and entry.future.done():
                    entry.outcome = entry.future.result()
                if entry.outcome is None and now >= entry.deadline:
                    entry.guard.cancel(f"no answer within load_timeout_s={self.timeout_s:g}")
                    logger.error("request %s: LMCache load still running after %.3g s; reported failed and its "
                                 "late writes refused (platforms.load_timeout_s)", req_id, self.timeout_s)
                    entry.outcome = False
                if entry.outcome is None:
                    continue
                del self._loads[req_id]
                results.finished.add(req_id)
                if not entry.outcome:
                    results.failed.add(req_id)
                    results.causes[req_id] = entry.guard.cause or "missing"
        return results

    def holds(self, req_id: str) -> bool:
        """Whether a load of ``req_id`` has not been reported yet (it may still read what its lookup pinned)."""
        with self._lock:
            return req_id in self._loads

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._loads)

    def shutdown(self) -> None:
        """Cancel what is still running (its writes are refused) and stop the loader thread without waiting
        for a backend that may never answer."""
        with self._lock:
            for entry in self._loads.values():
                entry.guard.cancel("connector shut down")
        self._executor.shutdown(wait=False, cancel_futures=True)
