"""CPU: synchronous copies into ordinary host memory, no streams."""

from __future__ import annotations

from lmcache_platforms.platforms.base import Platform


class CpuPlatform(Platform):
    name = "cpu"


PLATFORM = CpuPlatform()
