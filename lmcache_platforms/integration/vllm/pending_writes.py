"""Waiting for LMCache's storage writes still in flight, before an engine closes.

LMCache 0.5.6 writes to its remote and disk backends asynchronously (each backend keeps the keys being written
in ``put_tasks``) and its close does not wait for them, so a server stopped right after its last request lost
that request's last chunks: the next server missed them. Waiting is bounded: a stuck backend delays shutdown by
at most the time-out (``platforms.drain_timeout_s``), then what is left is logged (a miss later, never a corrupt
load: the chunk was not written).
"""

from __future__ import annotations

import time
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

def _in_flight(backend: Any) -> Any:
    """The collection of keys a backend is writing: the remote backend's ``put_tasks`` (a set), the local disk
    backend's worker's (a list); None for backends that write synchronously."""
    for owner in (backend, getattr(backend, "disk_worker", None)):
        tasks = getattr(owner, "put_tasks", None)
        if isinstance(tasks, set | list | dict):
            return tasks
    return None


def _collections(engine: Any) -> list[Any]:
    manager = getattr(engine, "storage_manager", None)
    if manager is None:
        return []
    return [tasks for b in manager.storage_backends.values() if (tasks := _in_flight(b)) is not None]


def pending_writes(engine: Any) -> int:
    """How many chunk writes of ``engine``'s backends have not finished."""
    return sum(len(tasks) for tasks in _collections(engine))


def drain_writes(engine: Any, timeout_s: float, poll_s: float = 0.02) -> int:
    """Wait until ``engine`` has no write in flight, at most ``timeout_s``; returns how many were pending at the
    start. Logs (never raises) when some are still pending at the time-out."""
    pending = pending_writes(engine)
    deadline = time.monotonic() + timeout_s
    while pending_writes(engine):
        if time.monotonic() > deadline:
            logger.warning("LMCache still had %d chunk writes in flight after %.0f s; closing without them "
                           "(those chunks will miss, nothing wrong is loaded)", pending_writes(engine), timeout_s)
            break
        time.sleep(poll_s)
    if pending:
        logger.info("waited for %d LMCache chunk writes in flight before closing", pending)
    return pending
