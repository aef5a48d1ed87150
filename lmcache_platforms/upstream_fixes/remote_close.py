"""Fixes for closing LMCache 0.5.6's remote backends (Redis, RESP, S3, ...), which could never return.

Their ``async close()`` runs on the executor's own event loop and calls the blocking
``AsyncPQExecutor.shutdown()``, which submits a coroutine to that same loop and waits for it: a deadlock, so
``LMCacheEngineBuilder.destroy`` hangs forever once a ``remote_url`` is configured. Called from its own
loop, this version hands back upstream's ``shutdown_async`` coroutine for the caller to await; from any
other thread it blocks as upstream's does.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from lmcache_platforms.config import PlatformSettings, connector_settings
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


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


def backend_settings(backend: Any) -> PlatformSettings:
    """Our settings as a remote backend sees them: its LMCache config and vLLM's keys from its metadata."""
    return connector_settings(backend.config, getattr(backend.metadata, "kv_connector_extra_config", None))


def wrap_remote_close(upstream: Callable[[Any], None]) -> Callable[[Any], None]:
    """Patch-catalog wrapper of ``RemoteBackend.close``, which waits without a limit for its connector's close.

    A connector's close first drains its job queue, and LMCache's executor cancels its workers before draining,
    so with a job still waiting on a store that does not answer the drain never ends and neither does the
    engine's shutdown. Upstream's close runs on a daemon thread, waited for ``platforms.remote_close_timeout_s``;
    past it the engine goes on closing without it (chunk writes still queued then miss later; nothing is
    loaded from them)."""

    def close(self: Any) -> None:
        timeout_s = backend_settings(self).remote_close_timeout_s
        if timeout_s <= 0:
            upstream(self)
            return
        closing = threading.Thread(target=upstream, args=(self,), daemon=True, name="lmcache-platforms-remote-close")
        closing.start()
        closing.join(timeout_s)
        if closing.is_alive():
            logger.warning("LMCache's remote store connection did not close within %.3g s "
                           "(platforms.remote_close_timeout_s); going on without it", timeout_s)

    close.upstream = upstream  # type: ignore[attr-defined]
    return close
