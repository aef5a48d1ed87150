"""CPU: synchronous copies into ordinary host memory, native C kernels."""

from __future__ import annotations

from lmcache_platforms.platforms.base import Platform


class CpuPlatform(Platform):
    name = "cpu"
    default_kernel_backend = "cpu"


PLATFORM = CpuPlatform()
