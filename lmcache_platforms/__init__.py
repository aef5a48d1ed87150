"""lmcache_platforms: LMCache in-process KV offloading for hybrid (multi KV-group) vLLM models.

Importing the package, or any module of it, activates it (see ``activation``); so do vLLM's plugin entry point,
building our connector and the ``lmcache-platforms`` command. Activation patches nothing by itself: every patch
waits for its upstream module to be imported, so a tool that needs only the layout math or the kernels, and never
imports LMCache or vLLM, leaves its process as it found it. ``LMCACHE_PLATFORMS_DISABLE=1`` opts out and
``status()`` reports what was done. Activation errors are logged here and re-raised by ``activate()``.
"""

from __future__ import annotations

from lmcache_platforms.activation import activate, activate_or_log, ensure_patched, status

__all__ = ["activate", "ensure_patched", "status"]
__version__ = "0.1.0"

activate_or_log()
