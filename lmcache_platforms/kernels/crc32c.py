"""CRC-32C of buffer stripes in the native CPU library (``csrc/cpu/crc32c.c``), for the chunk checksum.

The crc32 instruction on x86-64 (three stripes at once), a table elsewhere: the same values either way. ctypes
releases the GIL for the call, so several Python threads hash stripes in parallel. ``native()`` is None when
the library was not built, or is a build from before these functions (then rebuild it).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from lmcache_platforms.kernels.cpu_backend import REBUILD_HINT, load_library
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


class NativeCrc32c:
    """The library's CRC-32C entry points, argument types set."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._one = lib.lmcp_crc32c
        self._one.argtypes, self._one.restype = [vp, i64], ctypes.c_uint32
        self._stripes = lib.lmcp_crc32c_stripes
        self._stripes.argtypes, self._stripes.restype = [vp, i64, i64, i64, i64, vp], None
        self._portable = lib.lmcp_crc32c_portable
        self._portable.argtypes, self._portable.restype = [vp, i64], ctypes.c_uint32
        self.hardware = bool(lib.lmcp_crc32c_hardware())

    def crc(self, address: int, nbytes: int) -> int:
        """CRC-32C of ``nbytes`` at host ``address``."""
        return int(self._one(address, nbytes))

    def portable_crc(self, address: int, nbytes: int) -> int:
        """The same with the table, even where the instruction exists (tests compare the two)."""
        return int(self._portable(address, nbytes))

    def stripes(self, address: int, nbytes: int, stripe: int, first: int, last: int, out_address: int) -> None:
        """CRC-32C of stripes ``[first, last)`` of the ``nbytes`` at ``address`` into uint32s at
        ``out_address``."""
        self._stripes(address, nbytes, stripe, first, last, out_address)

    def object_stripes(self, buffer: torch.Tensor, objects: int, object_bytes: int, payload_bytes: int,
                       stripe: int) -> torch.Tensor:
        """CRC-32Cs (``[objects, stripes]`` int32) of the ``stripe``-byte stripes of the first ``payload_bytes`` of
        ``objects`` objects laid every ``object_bytes`` in the host uint8 ``buffer``: what the GPU kernel computes
        (``kernels.triton_crc32c``), for comparing it with."""
        count = -(-payload_bytes // stripe)
        out = torch.zeros((objects, count), dtype=torch.int32)
        for index in range(objects):
            self.stripes(buffer.data_ptr() + index * object_bytes, payload_bytes, stripe, 0, count,
                         out[index].data_ptr())
        return out


@functools.cache
def native() -> NativeCrc32c | None:
    """The native CRC-32C, or None without a (current) native library."""
    lib, _ = load_library()
    if lib is None:
        return None
    if not hasattr(lib, "lmcp_crc32c_portable"):
        logger.warning("the native CPU library predates its CRC-32C: chunk checksums use zlib's CRC-32, slower, "
                       "and servers with a current build do not share chunks with this one; %s", REBUILD_HINT)
        return None
    return NativeCrc32c(lib)
