"""The transfer contract and its backends; ``select_backend`` picks one per transfer group and device."""

from lmcache_platforms.kernels.contract import Direction, KernelBackend, TransferError, buffer_bytes
from lmcache_platforms.kernels.registry import BackendUnavailable, describe_backends, get_backend, select_backend

__all__ = [
    "BackendUnavailable",
    "Direction",
    "KernelBackend",
    "TransferError",
    "buffer_bytes",
    "describe_backends",
    "get_backend",
    "select_backend",
]
