"""LMCache's own code with patches/ applied and lmcache_platforms inactive: each patch's fix, seen through
upstream's classes alone (real LocalCPUBackend, LocalDiskBackend, RedisConnector and RemoteBackend over Debian's
redis-server, AsyncPQExecutor, ZMQOffloadServer).

``tests/upstream_fixes/test_patch_files.py`` runs this module in a subprocess whose path starts with a patched
copy of the pinned LMCache and has ``LMCACHE_PLATFORMS_DISABLE=1``; its name keeps pytest from collecting it in
the suite's own run, where LMCache is unpatched and our runtime fixes are tested instead.
"""

from __future__ import annotations

import asyncio
import gc
import os
import shutil
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest
import torch
import zmq

from tests.ci import missing

PATCHED_COPY_ENV = "LMCACHE_PLATFORMS_PATCHED_COPY"
CHUNK_SHAPE = torch.Size([2, 2, 16, 16])


@pytest.fixture(scope="module", autouse=True)
def patched_lmcache() -> None:
    """Every check runs on the patched copy, with nothing of ours installed."""
    import lmcache

    import lmcache_platforms

    assert Path(lmcache.__file__).is_relative_to(os.environ[PATCHED_COPY_ENV]), lmcache.__file__
    assert lmcache_platforms.status()["disabled"]


@pytest.fixture(scope="module")
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=5)


def _config(**options: Any) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=True, max_local_cpu_size=0.01, **options)


def _metadata() -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name="patched", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.float16, kv_shape=(2, 2, 16, 2, 8))


@pytest.fixture(scope="module")
def cpu_backend() -> Any:
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

    return LocalCPUBackend(_config(), _metadata(), dst_device="cpu")


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from lmcache_platforms.tools.redis_server import RedisServer

    if shutil.which("redis-server") is None:
        missing("redis-server is not on PATH (Debian package redis-server; scripts/test_services.sh installs it)")
    with RedisServer(str(tmp_path_factory.mktemp("redis"))) as server:
        yield server


def _key(chunk_hash: int) -> Any:
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey("patched", 1, 0, chunk_hash, torch.float16)


def _chunk(cpu_backend: Any, value: float) -> Any:
    from lmcache.v1.memory_management import MemoryFormat

    memory_obj = cpu_backend.allocate(CHUNK_SHAPE, torch.float16, MemoryFormat.KV_2LTD)
    memory_obj.tensor.fill_(value)
    return memory_obj


def taken_buffers() -> int:
    """LMCache MemoryObjs alive and still referenced."""
    from lmcache.v1.memory_management import MemoryObj

    return sum(1 for obj in gc.get_objects()
               if isinstance(obj, MemoryObj) and obj.is_valid() and obj.meta.ref_count > 0)


def _until(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_0001_the_offload_server_answers_every_request_and_closes(tmp_path: Path) -> None:
    """Upstream's loop left a malformed or failing request unanswered, and its close closed the socket under the
    thread's recv. The engine here refuses every store, as LMCache's engine does when its connector raises."""
    from lmcache.v1.offload_server.message import OffloadMsg, OffloadRetMsg
    from lmcache.v1.offload_server.zmq_server import ZMQOffloadServer
    from lmcache.v1.rpc_utils import get_zmq_socket

    def store(**_: Any) -> None:
        raise RuntimeError("no store")

    engine = SimpleNamespace(metadata=SimpleNamespace(engine_id=f"patched-{uuid.uuid4().hex[:8]}"), store=store)
    server = ZMQOffloadServer(engine, tp_rank=0)

    def ask(payload: bytes) -> bool:
        client = get_zmq_socket(server.ctx, server._socket_path, "ipc", zmq.REQ, "connect")
        try:
            client.setsockopt(zmq.RCVTIMEO, 5000)
            client.send(payload)
            return msgspec.msgpack.decode(client.recv(), type=OffloadRetMsg).success
        finally:
            client.close(linger=0)

    try:
        assert ask(msgspec.msgpack.encode(7)) is False
        assert ask(msgspec.msgpack.encode(OffloadMsg(hashes=[1], slot_mapping=list(range(16)), offsets=[16]))) is False
        assert ask(b"\xc1") is False
        assert server.thread.is_alive()
    finally:
        server.close()
    assert not server.thread.is_alive()
    assert server.socket.closed


def test_0002_shutdown_awaited_on_the_executors_own_loop_finishes(loop: asyncio.AbstractEventLoop) -> None:
    """What every remote connector's close does: ``await self.pq_executor.shutdown(wait=True)`` on that loop."""
    from lmcache.v1.storage_backend.job_executor.pq_executor import AsyncPQExecutor

    executor = AsyncPQExecutor(loop, max_workers=2)

    async def close() -> None:
        await executor.shutdown(wait=True)

    asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=5)
    assert executor._closed
    other = AsyncPQExecutor(loop, max_workers=2)
    assert other.shutdown(wait=True) is None
    assert other._closed and all(worker.done() for worker in other._workers)


@pytest.fixture
def disk(tmp_path: Path, loop: asyncio.AbstractEventLoop, cpu_backend: Any) -> Iterator[Any]:
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    backend = LocalDiskBackend(_config(local_disk=str(tmp_path), max_local_disk_size=0.01), loop, cpu_backend,
                               dst_device="cpu", metadata=_metadata())
    yield backend
    backend.close()


def _stored_on_disk(disk: Any, cpu_backend: Any, chunk_hash: int) -> tuple[Any, Path]:
    key, chunk = _key(chunk_hash), _chunk(cpu_backend, 3.0)
    disk.submit_put_task(key, chunk)
    _until(lambda: disk.contains(key) and not disk.exists_in_put_tasks(key))
    chunk.ref_count_down()
    return key, Path(disk.dict[key].path)


@pytest.mark.parametrize("damage", ["cut short", "deleted"])
def test_0003_a_disk_chunk_file_cut_short_or_deleted_is_a_miss_that_keeps_no_buffer(
        disk: Any, cpu_backend: Any, damage: str) -> None:
    """Upstream's single-chunk read (``get_blocking``) loaded a short file as a hit whose tail was the buffer's
    stale bytes, and a deleted one raised after taking a buffer."""
    key, path = _stored_on_disk(disk, cpu_backend, 11)
    loaded = disk.get_blocking(key)
    assert loaded is not None and bool((loaded.tensor == 3.0).all())
    loaded.ref_count_down()
    if damage == "deleted":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:1000])
    before = taken_buffers()
    assert disk.get_blocking(key) is None
    assert taken_buffers() == before
    assert not disk.contains(key)
    assert not path.exists()


@pytest.fixture
def redis_connector(redis_server: Any, loop: asyncio.AbstractEventLoop, cpu_backend: Any) -> Iterator[Any]:
    from lmcache.v1.storage_backend.connector.redis_connector import RedisConnector

    connector = RedisConnector(redis_server.url, loop, cpu_backend)
    yield connector
    asyncio.run_coroutine_threadsafe(connector.close(), loop).result(timeout=10)


def _put(connector: Any, loop: asyncio.AbstractEventLoop, cpu_backend: Any, chunk_hash: int) -> Any:
    key, chunk = _key(chunk_hash), _chunk(cpu_backend, 5.0)
    asyncio.run_coroutine_threadsafe(connector.put(key, chunk), loop).result(timeout=10)
    chunk.ref_count_down()
    return key


def test_0004_a_redis_value_of_the_wrong_length_is_a_miss_that_keeps_no_buffer(
        redis_server: Any, redis_connector: Any, loop: asyncio.AbstractEventLoop, cpu_backend: Any) -> None:
    import redis

    key = _put(redis_connector, loop, cpu_backend, 21)
    loaded = asyncio.run_coroutine_threadsafe(redis_connector.get(key), loop).result(timeout=10)
    assert loaded is not None and bool((loaded.tensor == 5.0).all())
    loaded.ref_count_down()
    with redis.Redis.from_url(redis_server.url) as client:
        name = key.to_string() + "kv_bytes"
        client.set(name, client.get(name)[:100])
    before = taken_buffers()
    assert asyncio.run_coroutine_threadsafe(redis_connector.get(key), loop).result(timeout=10) is None
    assert taken_buffers() == before


def test_0005_a_redis_connector_removes_both_values_of_a_chunk(
        redis_server: Any, redis_connector: Any, loop: asyncio.AbstractEventLoop, cpu_backend: Any) -> None:
    import redis

    key = _put(redis_connector, loop, cpu_backend, 31)
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.exists(key.to_string() + "metadata", key.to_string() + "kv_bytes") == 2
        assert redis_connector.remove_sync(key) is True
        assert client.exists(key.to_string() + "metadata", key.to_string() + "kv_bytes") == 0
    assert redis_connector.remove_sync(key) is False


def test_0006_a_batch_of_remote_writes_is_in_put_tasks_until_written_and_the_backend_closes(
        redis_server: Any, loop: asyncio.AbstractEventLoop, cpu_backend: Any) -> None:
    """The batch is sent while the server is stopped (SIGSTOP), so it cannot be written before it is looked for;
    closing the backend afterwards is patch 0002's path through a real connector's close."""
    import redis
    from lmcache.v1.storage_backend.remote_backend import RemoteBackend

    backend = RemoteBackend(_config(remote_url=redis_server.url, remote_serde="naive"), _metadata(), loop,
                            cpu_backend, dst_device="cpu")
    keys, chunks = [_key(41), _key(42)], [_chunk(cpu_backend, 7.0), _chunk(cpu_backend, 8.0)]
    os.kill(redis_server.process.pid, signal.SIGSTOP)
    try:
        backend.batched_submit_put_task(keys, chunks)
        assert all(backend.exists_in_put_tasks(key) for key in keys)
    finally:
        os.kill(redis_server.process.pid, signal.SIGCONT)
    _until(lambda: not any(backend.exists_in_put_tasks(key) for key in keys))
    for chunk in chunks:
        chunk.ref_count_down()
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.exists(*(key.to_string() + "kv_bytes" for key in keys)) == 2
    closing = threading.Thread(target=backend.close, daemon=True)
    closing.start()
    closing.join(timeout=10)
    assert not closing.is_alive()


def test_0008_closing_the_async_lookup_client_and_server_wakes_their_threads_first(
        capfd: pytest.CaptureFixture[str]) -> None:
    """Upstream's close gave each thread, blocked in ``recv``, one second, then closed its socket and terminated the
    context under it ("Context was terminated"; libzmq could abort the process). The server's engine records the
    clean-up the wake-up asks for."""
    from lmcache.v1.lookup_client.lmcache_async_lookup_client import (
        LMCacheAsyncLookupClient,
        LMCacheAsyncLookupServer,
    )

    metadata = _metadata()
    metadata.engine_id = f"patched-{uuid.uuid4().hex[:8]}"
    cleaned: list[str] = []
    server = LMCacheAsyncLookupServer(SimpleNamespace(cleanup_memory_objs=cleaned.append), metadata)
    client = LMCacheAsyncLookupClient(_config(), metadata)
    started = time.perf_counter()
    client.close()
    server.close()
    assert time.perf_counter() - started < 0.5
    assert not client.thread.is_alive() and not server.thread.is_alive()
    assert cleaned == ["lmcache-platforms-close"]
    output = capfd.readouterr()
    assert "Context was terminated" not in output.out + output.err
