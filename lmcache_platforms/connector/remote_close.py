"""A fix for closing LMCache 0.5.6's remote backends (Redis, RESP, S3, ...), which never returns.

Their ``async close()`` runs on the executor's own event loop and calls the blocking
``AsyncPQExecutor.shutdown()``, which submits a coroutine to that same loop and waits for it: a deadlock, so
``LMCacheEngineBuilder.destroy`` hangs forever once a ``remote_url`` is configured. Called from its own
loop, this version hands back upstream's ``shutdown_async`` coroutine for the caller to await; from any
other thread it blocks as upstream's does.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


def pq_executor_shutdown(self: Any, wait: bool = True) -> Coroutine[Any, Any, None] | None:
    """Replacement for ``AsyncPQExecutor.shutdown``: awaitable on its own loop, blocking elsewhere."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is self.loop:
        return self.shutdown_async(wait)
    future = asyncio.run_coroutine_threadsafe(self.shutdown_async(wait), self.loop)
    if wait:
        future.result()
    return None
