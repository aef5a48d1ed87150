"""The check our vLLM connector runs before it builds its engine impl: activation applied the patch catalog.

Activation and the catalog sit above this package (the catalog names its modules), so activation installs its
check here instead of this package importing it. Activation is imported by ``lmcache_platforms/__init__.py``,
which Python runs before any submodule, so the check is in place wherever our connector module is; running it
activates the process if activation has not succeeded yet (it may have failed, or been rolled back).
"""

from __future__ import annotations

from collections.abc import Callable

_check: Callable[[], object] | None = None


def install(check: Callable[[], object]) -> None:
    """Called once by ``lmcache_platforms.activation``: ``check`` activates if needed and raises, saying why,
    when lmcache_platforms is disabled or its patches failed."""
    global _check
    _check = check


def ensure_ready() -> None:
    """Raise unless the patches our engine impl relies on are in place."""
    if _check is None:
        raise RuntimeError("lmcache_platforms.activation was never imported in this process, so nothing checks "
                           "that LMCache is patched: import lmcache_platforms before building its connector")
    _check()
