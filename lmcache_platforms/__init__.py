"""lmcache_platforms: LMCache in-process KV offloading for hybrid (multi KV-group) vLLM models.

Importing the package activates it (see ``activation``); ``LMCACHE_PLATFORMS_DISABLE=1`` opts out and
``status()`` reports what was done. Activation errors are logged here and re-raised by ``activate()``.
"""

from __future__ import annotations

from lmcache_platforms.activation import activate, ensure_patched, status
from lmcache_platforms.log import init_logger

__all__ = ["activate", "ensure_patched", "status"]
__version__ = "0.1.0"

try:
    activate()
except Exception as _exc:  # noqa: BLE001 - importing must not break the host process; status() carries it
    init_logger(__name__).error("lmcache_platforms not activated: %s", _exc)
