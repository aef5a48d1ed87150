"""lmcache_platforms: LMCache in-process KV offloading for hybrid (multi KV-group) vLLM models.

``import lmcache_platforms`` activates it (see ``activation``); so do vLLM's plugin entry point, building our
connector and the ``lmcache-platforms`` command. Importing only a submodule (``import lmcache_platforms.layout``,
``python -m lmcache_platforms.<module>``) activates nothing: tools that need the layout math or the kernels must
not patch the process they run in. ``LMCACHE_PLATFORMS_DISABLE=1`` opts out and ``status()`` reports what was
done. Activation errors are logged here and re-raised by ``activate()``.
"""

from __future__ import annotations

import sys
from types import FrameType

from lmcache_platforms.activation import activate, activate_or_log, ensure_patched, status

__all__ = ["activate", "ensure_patched", "status"]
__version__ = "0.1.0"

# The import machinery frames (and their locals) that name the module an import is really for: the package runs
# first as the parent of a submodule import, and runpy imports it before running ``-m lmcache_platforms.<x>``.
_IMPORT_FRAMES = {"_find_and_load_unlocked": "name", "_get_module_details": "mod_name"}


def _imported_as_parent_of_a_submodule() -> bool:
    """Whether this package is being imported only on the way to one of its submodules."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        local = _IMPORT_FRAMES.get(frame.f_code.co_name)
        target = frame.f_locals.get(local) if local else None
        if isinstance(target, str) and target.startswith(f"{__name__}."):
            return True
        frame = frame.f_back
    return False


if not _imported_as_parent_of_a_submodule():
    activate_or_log()
