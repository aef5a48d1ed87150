"""A fix for closing LMCache 0.5.6's remote backends (Redis, RESP, S3, ...), which never returns.

Their ``async close()`` runs on the executor's own event loop and calls the blocking
``AsyncPQExecutor.shutdown()``, which submits a coroutine to that same loop and waits for it: a deadlock, so
``LMCacheEngineBuilder.destroy`` hangs forever once a ``remote_url`` is configured. (Even run on the loop,
upstream's ``shutdown_async(wait=True)`` cancels the workers before joining the queue they would have
drained, so it cannot finish either.) Called from the loop, this version hands back a coroutine that stops
the workers without waiting for the queue; from any other thread it behaves as upstream's.
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
        return self.shutdown_async(wait=False)
    future = asyncio.run_coroutine_threadsafe(self.shutdown_async(wait), self.loop)
    if wait:
        future.result()
    return None
