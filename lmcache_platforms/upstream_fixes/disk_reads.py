"""A fix for LMCache 0.5.6's local disk backend, which loads a chunk whose file is gone or cut short as a hit.

``LocalDiskBackend.read_file`` fills the chunk's buffer with one ``readinto`` and never checks how many bytes
came back; on a missing file it logs, drops the key and returns normally. The batched read path then sees
the key gone and reports a miss, but the single-chunk path (``get_blocking`` -> ``load_bytes_from_disk``)
returns the buffer anyway, and a file cut short is a hit on both paths: the chunk's tail is whatever the
allocator's buffer held before (stale KV of another chunk), loaded into vLLM as if it were this chunk's.

Here ``read_file`` raises ``ChunkFileError`` when the file is missing or its size is not the chunk's (a
short or overlong file is removed from the index and the disk, as upstream does for a missing one), and
``load_bytes_from_disk`` turns that (or any other error of the read) into a miss that frees its buffer, as the
batched path already does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


class ChunkFileError(OSError):
    """A chunk's file on disk cannot be its bytes: missing, or not the chunk's size."""


def checked_read_file(original: Callable[..., None]) -> Callable[..., None]:
    """Wraps ``LocalDiskBackend.read_file`` (upstream's read, O_DIRECT included) with a size check."""

    def read_file(self: Any, key: Any, buffer: Any, path: str) -> None:
        expected = memoryview(buffer).nbytes
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            size = None
        if size is not None and size != expected:
            logger.error("LMCache disk chunk %s holds %d bytes, the chunk %d: dropped, not loaded", path, size,
                         expected)
            with contextlib.suppress(FileNotFoundError):  # deleted meanwhile: the key is dropped all the same
                self.remove(key)
            raise ChunkFileError(f"{path}: {size} bytes on disk, the chunk has {expected}")
        original(self, key, buffer, path)
        with self.disk_lock:
            present = key in self.dict
        if size is None or not present:  # upstream found it missing (then or during the read) and dropped it
            raise ChunkFileError(f"{path}: the chunk's file is missing")

    return read_file


def load_bytes_from_disk(self: Any, key: Any, path: str, dtype: Any, shape: Any, fmt: Any) -> Any:
    """Replacement for ``LocalDiskBackend.load_bytes_from_disk``: the chunk's MemoryObj, or None (its buffer
    freed) when there is no buffer to read into or the file cannot be its bytes."""
    memory_obj = self.local_cpu_backend.allocate(shape, dtype, fmt)
    if memory_obj is None:
        logger.warning("no LMCache buffer free to read disk chunk %s: a miss", path)
        return None
    try:
        self.read_file(key, memory_obj.byte_array, path)
    except OSError as exc:  # ours, or the same check's error where patches/ put it into LMCache itself
        logger.warning("LMCache disk chunk not loaded: %s", exc)
        memory_obj.ref_count_down()
        return None
    with self.disk_lock:
        meta = self.dict.get(key)
    if meta is None:
        memory_obj.ref_count_down()
        return None
    memory_obj.metadata.cached_positions = meta.cached_positions
    return memory_obj
