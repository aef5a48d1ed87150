"""The fix for LMCache 0.5.6's remote connectors, whose async close() deadlocks on the executor's loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest
from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor

from lmcache_platforms.upstream_fixes.remote_close import pq_executor_shutdown


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)
    loop.close()


async def _double(value: int) -> int:
    return 2 * value


def test_close_on_the_executor_loop_finishes_after_the_queued_work(loop: asyncio.AbstractEventLoop) -> None:
    executor = AsyncPQExecutor(loop, max_workers=2)
    done = asyncio.run_coroutine_threadsafe(executor.submit_job(_double, 21, priority=0), loop)
    assert done.result(timeout=5) == 42

    async def close() -> None:  # what RedisConnector.close() does, with the fixed shutdown
        await pq_executor_shutdown(executor, wait=True)

    asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=5)
    assert executor._closed


def test_close_from_another_thread_blocks_until_done(loop: asyncio.AbstractEventLoop) -> None:
    executor = AsyncPQExecutor(loop, max_workers=2)
    assert pq_executor_shutdown(executor, wait=True) is None
    assert executor._closed
    assert all(worker.done() for worker in executor._workers)
