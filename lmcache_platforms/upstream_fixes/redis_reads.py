"""A fix for LMCache 0.5.6's Redis connectors, which keep a chunk buffer taken for every value they cannot read.

``RedisConnector._get`` (and ``RedisClusterConnector._get``, the same code over a cluster client) allocates
the chunk's MemoryObj from the ``metadata`` value, then copies the ``kv_bytes`` value into it. A value that is
not ``metadata.length`` bytes (truncated, overwritten, or the metadata rewritten) makes that copy raise;
LMCache's remote backend turns the exception into a miss, but the MemoryObj is never released. It stays taken
until Python's cycle collector finds it (LMCache then logs "being garbage collected with ref_count=1"):
meanwhile that much of LMCache's CPU buffer is lost, stores are skipped, and a retrieve allocating with
LMCache's busy loop can wait for it.

This replacement reads both values first, refuses a ``kv_bytes`` of the wrong length before allocating, and
releases the buffer if the copy still fails; otherwise it behaves as upstream's (a missing ``kv_bytes``
deletes the orphan ``metadata``).

Both connectors also inherit ``remove_sync`` unimplemented (LMCache logs the exception and removes nothing):
``wrap_remote_remove_sync`` deletes a chunk's values, which a load that finds a chunk corrupt relies on.
"""

from __future__ import annotations

import asyncio
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


async def redis_get(self: Any, key: Any) -> Any:
    """Replacement for ``RedisConnector._get``: the chunk's MemoryObj, or None with nothing left allocated."""
    return await _checked_get(self, self.connection, key)


async def redis_cluster_get(self: Any, key: Any) -> Any:
    """Replacement for ``RedisClusterConnector._get`` (its client is ``cluster``), as ``redis_get``."""
    return await _checked_get(self, self.cluster, key)


async def _checked_get(self: Any, client: Any, key: Any) -> Any:
    from lmcache.v1.protocol import RemoteMetadata

    key_str = key.to_string()
    async with self.sem:
        metadata_bytes = await client.get(key_str + "metadata")
        if metadata_bytes is None:
            return None
        metadata = RemoteMetadata.deserialize(memoryview(metadata_bytes))
        kv_bytes = await client.get(key_str + "kv_bytes")
        if kv_bytes is None:
            logger.warning("Redis has the metadata of LMCache chunk %s but not its bytes (evicted?): a miss",
                           key_str)
            await client.delete(key_str + "metadata")
            return None
    data = memoryview(kv_bytes.encode() if isinstance(kv_bytes, str) else kv_bytes).cast("B")
    if data.nbytes != metadata.length:
        logger.error("Redis value of LMCache chunk %s holds %d bytes, its metadata says %d: not loaded", key_str,
                     data.nbytes, metadata.length)
        return None
    memory_obj = self.local_cpu_backend.allocate(metadata.shapes, metadata.dtypes, metadata.fmt)
    if memory_obj is None:
        logger.warning("no LMCache buffer free to receive Redis chunk %s: a miss", key_str)
        return None
    try:
        view = memory_obj.byte_array
        view = view.cast("B") if isinstance(view, memoryview) else memoryview(view)
        view[: metadata.length] = data
    except Exception:
        memory_obj.ref_count_down()
        raise
    return memory_obj


_REMOVE_TIMEOUT_S = 5.0


def wrap_remote_remove_sync(upstream: Any) -> Any:
    """Patch-catalog wrapper of ``RemoteConnector.remove_sync``, which the Redis connectors inherit unimplemented
    (it raises): for them, delete the chunk's two values, so an object that failed its checksum
    (``connector.verified_loads``) is not found again; every other connector keeps its own behaviour."""

    def remove_sync(self: Any, key: Any) -> bool:
        """Remove one chunk from a Redis or Redis Cluster store: whether anything was deleted."""
        client = _redis_client(self)
        if client is None:
            return upstream(self, key)
        key_str = key.to_string()

        async def delete() -> int:
            async with self.sem:
                # Metadata first: lookups test it, so the chunk stops existing before its bytes go.
                return int(await client.delete(key_str + "metadata")) + int(await client.delete(key_str + "kv_bytes"))

        future = asyncio.run_coroutine_threadsafe(delete(), self.loop)
        return bool(future.result(timeout=_REMOVE_TIMEOUT_S))

    return remove_sync


def _redis_client(connector: Any) -> Any:
    """The Redis client of LMCache's Redis or Redis Cluster connector, None for any other connector."""
    try:
        from lmcache.v1.storage_backend.connector.redis_connector import RedisClusterConnector, RedisConnector
    except ImportError:
        return None
    if isinstance(connector, RedisConnector):
        return connector.connection
    if isinstance(connector, RedisClusterConnector):
        return connector.cluster
    return None
