"""The native CPU library (``csrc/cpu``, built by setup.py as ``lmcache_platforms.kernels._cpu_transfer``), loaded
once with ctypes and its transfer entry points typed: the CPU transfer backend and the CRC-32C both call into it,
so neither owns it."""

from __future__ import annotations

import ctypes
import functools

from lmcache_platforms.kernels.plane_table import ABI_VERSION, built_library

LIBRARY_MODULE = "lmcache_platforms.kernels._cpu_transfer"
REBUILD_HINT = "rebuild with `python setup.py build_ext --inplace` or `pip install -e .`"


@functools.cache
def load_library() -> tuple[ctypes.CDLL | None, str]:
    """(the loaded library, "") or (None, why it cannot be used)."""
    path, why = built_library(LIBRARY_MODULE, REBUILD_HINT)
    if path is None:
        return None, why
    try:
        lib = ctypes.CDLL(path)
        version = lib.lmcp_abi_version()
    except (OSError, AttributeError) as exc:
        return None, f"cannot load {path}: {exc}; {REBUILD_HINT}"
    if version != ABI_VERSION:
        return None, f"{path} has ABI {version}, this package needs {ABI_VERSION}; {REBUILD_HINT}"
    if not hasattr(lib, "lmcp_transfer_load_crc"):
        return None, f"{path} predates the load that hashes as it copies; {REBUILD_HINT}"
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.lmcp_transfer.argtypes = [vp, i64, vp, i64, i64, vp, ctypes.c_int, ctypes.c_int]
    lib.lmcp_transfer.restype = ctypes.c_int
    lib.lmcp_transfer_crc.argtypes = [vp, i64, vp, i64, i64, vp, ctypes.c_int, i64, i64, i64, vp, vp]
    lib.lmcp_transfer_crc.restype = ctypes.c_int
    lib.lmcp_transfer_load_crc.argtypes = lib.lmcp_transfer_crc.argtypes
    lib.lmcp_transfer_load_crc.restype = ctypes.c_int
    lib.lmcp_transfer_checked.argtypes = [vp, i64, vp, i64, i64, vp, ctypes.c_int, i64, vp, i64, i64, vp, vp]
    lib.lmcp_transfer_checked.restype = ctypes.c_int
    return lib, ""
