"""Loggers that print like LMCache's own, without importing LMCache (importing it early crashed vLLM workers).

Every module logs through ``init_logger(__name__)``; all of them hang under one ``lmcache_platforms`` parent
whose single handler uses LMCache's formatter when LMCache is already loaded, its format otherwise, and
LMCache's level switch ``LMCACHE_LOG_LEVEL``.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "lmcache_platforms"
_FALLBACK_FORMAT = "[%(asctime)s] LMCache %(levelname)s: %(message)s (%(filename)s:%(lineno)d:%(name)s)"


def _configure_root() -> logging.Logger:
    root = logging.getLogger(ROOT)
    if root.handlers:
        return root
    handler = logging.StreamHandler()
    upstream = sys.modules.get("lmcache.logging")
    formatter = upstream.CustomFormatter() if upstream is not None else logging.Formatter(_FALLBACK_FORMAT)
    handler.setFormatter(formatter)
    root.addHandler(handler)
    root.setLevel(getattr(logging, os.getenv("LMCACHE_LOG_LEVEL", "INFO").upper(), logging.INFO))
    root.propagate = False
    return root


def init_logger(name: str) -> logging.Logger:
    """A logger for one of our modules (``name`` is its ``__name__``)."""
    _configure_root()
    return logging.getLogger(name if name.startswith(ROOT) else f"{ROOT}.{name}")
