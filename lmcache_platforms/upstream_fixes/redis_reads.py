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
"""

from __future__ import annotations

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
