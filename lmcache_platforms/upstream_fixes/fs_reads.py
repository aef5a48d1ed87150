"""Batched lookups and reads for LMCache 0.5.6's ``fs://`` connector, which hands every step of every object to a
thread.

``FSConnector`` asks whether an object exists with ``aiofiles`` (one thread hand-off per object) and reads one
with ``aiofiles`` too: open, the metadata header, the bytes, close, each a hand-off from its event loop to the
default executor and back; LMCache's remote backend then waits for the objects one after another. A load of a
2,048-token hit (a dozen objects) paid dozens of hand-offs. Here the connector answers LMCache's batched forms
(announced by ``batched_remote``): a lookup tests the files in the calling thread (a ``stat`` each, no
hand-off), and a load reads every object in one executor job, with plain blocking reads, the same way upstream
reads one (header, allocation from the header's shape, the bytes, a short file refused; without chunk
metadata, a short file is a partial chunk as upstream makes it; with ``O_DIRECT``, upstream's own direct read).
It stops at the first object it cannot have: LMCache loads the objects up to it, so none after it is read.
"""

from __future__ import annotations

import os
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


def is_fs(connector: Any) -> bool:
    """Whether ``connector`` is LMCache's ``fs://`` connector."""
    try:
        from lmcache.v1.storage_backend.connector.fs_connector import FSConnector
    except ImportError:
        return False
    return isinstance(connector, FSConnector)


def batched_contains(self: Any, keys: list[Any]) -> int:
    """How many of ``keys``, from the first, have their file."""
    for held, key in enumerate(keys):
        if not os.path.exists(self._get_file_path(key)):
            return held
    return len(keys)


async def batched_get(self: Any, keys: list[Any]) -> list[Any]:
    """Every object of ``keys`` read in one executor job; None from the first it cannot have on."""
    return await self.loop.run_in_executor(None, _read_all, self, keys)


def _read_all(self: Any, keys: list[Any]) -> list[Any]:
    read: list[Any] = []
    for key in keys:
        read.append(_read(self, key) if not read or read[-1] is not None else None)
    return read


def _read(self: Any, key: Any) -> Any:
    """One object, as upstream's ``FSConnector.get`` reads it, or None with nothing left allocated."""
    path = self._get_file_path(key)
    if self.use_odirect and not self.save_chunk_meta:
        return self._get_with_odirect(path)
    memory_obj = None
    try:
        with open(path, "rb") as file:
            memory_obj = _allocate(self, file, path)
            if memory_obj is None:
                return None
            buffer = memory_obj.byte_array
            num_read = file.readinto(buffer)
            if not self.save_chunk_meta:
                return self.reshape_partial_chunk(memory_obj, num_read)
            if num_read != len(buffer):
                raise RuntimeError(f"Partial read data {len(buffer)} got {num_read}")
            return memory_obj
    except Exception as exc:  # noqa: BLE001 - as upstream: a file that cannot be read is a miss
        if not isinstance(exc, FileNotFoundError):
            logger.error("Failed to read LMCache chunk file %s: %s", path, exc)
        if memory_obj is not None:
            memory_obj.ref_count_down()
        return None


def _allocate(self: Any, file: Any, path: Any) -> Any:
    """The object's buffer, shaped by the file's metadata header where the connector writes one."""
    if not self.save_chunk_meta:
        return self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes, self.meta_fmt)
    from lmcache.v1.protocol import RemoteMetadata

    header = bytearray(self.remote_metadata_bytes)
    num_read = file.readinto(header)
    if num_read != len(header):
        raise RuntimeError(f"Partial read meta {len(header)} got {num_read}")
    metadata = RemoteMetadata.deserialize(header)
    memory_obj = self.local_cpu_backend.allocate(metadata.shapes, metadata.dtypes, metadata.fmt)
    if memory_obj is None:
        logger.debug("no LMCache buffer free to read chunk file %s", path)
    return memory_obj
