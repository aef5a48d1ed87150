"""The one list of every upstream symbol lmcache_platforms replaces. Nothing is patched anywhere else."""

from __future__ import annotations

from lmcache_platforms.patching.patch import Patch

LMCACHE = "lmcache==0.5.6"

PATCHES: tuple[Patch, ...] = ()
