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

Both ask the store one chunk object at a time: a lookup sends one ``EXISTS`` per object and waits for each
answer before the next; a load sends two ``GET``s per object, one after the other, at most four objects at a
time. A chunk is several objects (one per part), so a 2,048-token hit was dozens of round trips. Here both
answer LMCache's batched forms (``batched_get``, ``batched_contains``, announced by ``batched_remote``; the
async lookup's ``_batched_async_contains``) with one pipeline: every ``EXISTS``, or both values of every
object, in one round trip (on a cluster, one per node holding some of them, sent together). Each value is then
checked as above. On one ``redis://`` server over plain TCP a load's pipeline is read on a connection of our
own, each value straight into its buffer (``redis_socket_reads``).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from lmcache_platforms.log import init_logger
from lmcache_platforms.upstream_fixes import redis_socket_reads

logger = init_logger(__name__)


async def redis_get(self: Any, key: Any) -> Any:
    """Replacement for ``RedisConnector._get``: the chunk's MemoryObj, or None with nothing left allocated."""
    return await _checked_get(self, self.connection, key)


async def redis_cluster_get(self: Any, key: Any) -> Any:
    """Replacement for ``RedisClusterConnector._get`` (its client is ``cluster``), as ``redis_get``."""
    return await _checked_get(self, self.cluster, key)


async def _checked_get(self: Any, client: Any, key: Any) -> Any:
    key_str = key.to_string()
    async with self.sem:
        metadata_bytes = await client.get(key_str + "metadata")
        if metadata_bytes is None:
            return None
        kv_bytes = await client.get(key_str + "kv_bytes")
        if kv_bytes is None:
            await _drop_orphans(client, [key_str])
            return None
    return _received(self, key_str, metadata_bytes, kv_bytes)


async def _drop_orphans(client: Any, key_strs: list[str]) -> None:
    """Delete the ``metadata`` of chunks whose bytes are gone (evicted, a cluster node restarted), so lookups
    stop finding them."""
    for key_str in key_strs:
        logger.warning("Redis has the metadata of LMCache chunk %s but not its bytes (evicted?): a miss", key_str)
    await client.delete(*(key_str + "metadata" for key_str in key_strs))


def _allocated(self: Any, key_str: str, metadata_bytes: Any, length: int) -> Any:
    """A MemoryObj to receive the chunk's ``length`` bytes, or None (not the length its metadata says, no buffer
    free) with nothing allocated."""
    from lmcache.v1.protocol import RemoteMetadata

    metadata = RemoteMetadata.deserialize(memoryview(metadata_bytes))
    if length != metadata.length:
        logger.error("Redis value of LMCache chunk %s holds %d bytes, its metadata says %d: not loaded", key_str,
                     length, metadata.length)
        return None
    memory_obj = self.local_cpu_backend.allocate(metadata.shapes, metadata.dtypes, metadata.fmt)
    if memory_obj is None:
        logger.warning("no LMCache buffer free to receive Redis chunk %s: a miss", key_str)
    return memory_obj


def _byte_view(memory_obj: Any) -> memoryview:
    """A MemoryObj's bytes, writable."""
    view = memory_obj.byte_array
    return view.cast("B") if isinstance(view, memoryview) else memoryview(view)


def _received(self: Any, key_str: str, metadata_bytes: Any, kv_bytes: Any) -> Any:
    """The chunk's MemoryObj holding ``kv_bytes``, or None (wrong length, no buffer free) with nothing allocated."""
    data = memoryview(kv_bytes.encode() if isinstance(kv_bytes, str) else kv_bytes).cast("B")
    memory_obj = _allocated(self, key_str, metadata_bytes, data.nbytes)
    if memory_obj is None:
        return None
    try:
        _byte_view(memory_obj)[: data.nbytes] = data
    except Exception:
        memory_obj.ref_count_down()
        raise
    return memory_obj


def _pipeline(client: Any) -> Any:
    """Many commands in one round trip; not a transaction, so a cluster client sends each node its share."""
    return client.pipeline(transaction=False)


async def _both_values(self: Any, keys: list[Any], command: Literal["get", "exists"]) -> list[tuple[str, Any, Any]]:
    """Per key: (its name, ``command``'s answer for its ``metadata``, for its ``kv_bytes``), both values of every
    key in one pipeline; a ``metadata`` whose bytes are gone is deleted (writers set the bytes first)."""
    client = redis_client(self)
    names = [key.to_string() for key in keys]
    async with self.sem:
        pipe = _pipeline(client)
        for name in names:
            getattr(pipe, command)(name + "metadata")
            getattr(pipe, command)(name + "kv_bytes")
        answers = await pipe.execute()
        triples = list(zip(names, answers[0::2], answers[1::2], strict=True))
        suspects = [index for index, (_, metadata, data) in enumerate(triples) if _held(metadata) and not _held(data)]
        if suspects:
            # A cluster keeps the two values on the nodes of their own slots and the pipeline asks those nodes at
            # once: the bytes may have been asked before a writer set them and the metadata after. Asked again
            # now, once the metadata was seen, bytes a writer set are there; only bytes still missing are gone.
            pipe = _pipeline(client)
            for index in suspects:
                getattr(pipe, command)(names[index] + "kv_bytes")
            for index, data in zip(suspects, await pipe.execute(), strict=True):
                triples[index] = (names[index], triples[index][1], data)
            orphans = [names[index] for index in suspects if not _held(triples[index][2])]
            if orphans:
                await _drop_orphans(client, orphans)
    return triples


def _held(answer: Any) -> bool:
    """Whether a ``GET`` (a value, None when absent) or ``EXISTS`` (a count) answer says the value is there."""
    return answer is not None and answer != 0


async def _batched_get(self: Any, keys: list[Any]) -> list[Any]:
    reader = redis_socket_reads.reader_of(self)
    if reader is not None:
        try:
            by_socket = await asyncio.to_thread(_read_by_socket, self, reader, keys)
        except TimeoutError:
            raise  # a store past its socket_timeout: redis-py would wait as long again
        except Exception as exc:  # noqa: BLE001 - redis-py reads the load instead, and reports a store down
            logger.warning("Redis load on lmcache_platforms' own connection failed (%s: %s): read through redis-py",
                           type(exc).__name__, exc)
        else:
            if by_socket is not None:
                return by_socket
    pairs = await _both_values(self, keys, "get")
    # LMCache loads the objects up to the first it cannot have: none after it is received (or allocated).
    received: list[Any] = []
    for key_str, metadata, data in pairs:
        memory_obj = None
        if metadata is not None and data is not None and (not received or received[-1] is not None):
            try:
                memory_obj = _received(self, key_str, metadata, data)
            except Exception as exc:  # noqa: BLE001 - one unreadable object is a miss there, as a single read's
                logger.error("Redis chunk %s cannot be read (%s: %s): not loaded", key_str, type(exc).__name__, exc)
        received.append(memory_obj)
    return received


def _read_by_socket(self: Any, reader: redis_socket_reads.SocketReader, keys: list[Any]) -> list[Any] | None:
    """``_batched_get`` on the connector's own connection, each value read into its buffer; None (nothing kept)
    where an object's ``metadata`` came without its ``kv_bytes``, which ``_both_values`` sorts out."""
    names = [key.to_string() for key in keys]
    taken: list[Any] = [None] * len(keys)

    def receive(index: int, metadata: bytes, length: int) -> memoryview | None:
        if index > 0 and taken[index - 1] is None:  # the hit ended before this object
            return None
        try:
            taken[index] = _allocated(self, names[index], metadata, length)
        except Exception as exc:  # noqa: BLE001 - one unreadable object is a miss there, as a single read's
            logger.error("Redis chunk %s cannot be read (%s: %s): not loaded", names[index], type(exc).__name__, exc)
        return None if taken[index] is None else _byte_view(taken[index])[:length]

    try:
        received = reader.read(names, receive)
    except BaseException:
        _release(taken)
        raise
    if any(r.metadata is not None and not r.kv_held for r in received):
        _release(taken)
        return None
    return taken


def _release(memory_objs: list[Any]) -> None:
    for memory_obj in memory_objs:
        if memory_obj is not None:
            memory_obj.ref_count_down()


async def _present_prefix(self: Any, keys: list[Any]) -> int:
    """How many of ``keys``, from the first, the store holds whole: both values of each (an ``EXISTS`` each, all
    in one pipeline). Upstream asks for the ``metadata`` alone, but the two values are two keys, which a cluster
    keeps on the nodes of their own hash slots: a node restarted, or an eviction, can take the bytes and leave
    the metadata, and a lookup that claimed that object made its load fail. Metadata left without bytes (writers
    set the bytes first) is deleted, as a read that finds it does."""
    found = await _both_values(self, keys, "exists")
    return next((index for index, (_, metadata, data) in enumerate(found) if not (metadata and data)), len(found))


def _priority(name: str) -> int:
    from lmcache.v1.storage_backend.connector.redis_connector import Priorities

    return int(Priorities[name])


async def batched_get(self: Any, keys: list[Any]) -> list[Any]:
    """A Redis connector's read of ``keys`` (``upstream_fixes.batched_remote``), as a job of its executor."""
    return await self.pq_executor.submit_job(_batched_get, self, keys, priority=_priority("GET"))


def batched_contains(self: Any, keys: list[Any]) -> int:
    """A Redis connector's stored prefix of ``keys``; called off the connector's loop (LMCache's lookup server,
    a retrieve), as upstream's ``exists_sync``."""
    job = self.pq_executor.submit_job(_present_prefix, self, keys, priority=_priority("PEEK"))
    return asyncio.run_coroutine_threadsafe(job, self.loop).result()


async def redis_async_contains(self: Any, lookup_id: str, keys: list[Any], pin: bool = False) -> int:
    """Replacement for both Redis connectors' ``_batched_async_contains`` (LMCache's asynchronous lookup, run by
    their job executor): the stored prefix in one pipeline instead of one ``EXISTS`` round trip per object."""
    return await _present_prefix(self, keys)


_REMOVE_TIMEOUT_S = 5.0


def wrap_remote_remove_sync(upstream: Any) -> Any:
    """Patch-catalog wrapper of ``RemoteConnector.remove_sync``, which the Redis connectors inherit unimplemented
    (it raises): for them, delete the chunk's two values, so an object that failed its checksum
    (``connector.chunk_loads``) is not found again; every other connector keeps its own behaviour."""

    def remove_sync(self: Any, key: Any) -> bool:
        """Remove one chunk from a Redis or Redis Cluster store: whether anything was deleted."""
        client = redis_client(self)
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


def redis_client(connector: Any) -> Any:
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
