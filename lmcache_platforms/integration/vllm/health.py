"""Whether the LMCache engines of this process work, so "degraded mode" is never silent.

Upstream swallows engine initialisation errors: the connector keeps running, every request is recomputed,
and nothing but one log line says so. Our engine impl records each role's outcome here, logs an error when
it is degraded, and ``doctor`` / ``lmcache_platforms.status()`` read ``engine_health()``.
"""

from __future__ import annotations

import threading
from dataclasses import asdict, dataclass
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class EngineHealth:
    """One connector role's engine state: ``degraded`` means LMCache is off and vLLM recomputes everything."""

    role: str
    stage: str
    degraded: bool
    reason: str = ""


_lock = threading.Lock()
_records: dict[str, EngineHealth] = {}


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


def record(role: str, stage: str, manager: Any) -> EngineHealth:
    """Read an ``LMCacheManager``'s failure flag after ``stage`` (init, post_init) and remember it."""
    failed = bool(getattr(manager, "_init_failed", False))
    reason = _last_line(str(getattr(manager, "_init_failed_reason", "") or "")) if failed else ""
    health = EngineHealth(role=role, stage=stage, degraded=failed, reason=reason)
    with _lock:
        _records[role] = health
    if failed:
        logger.error(
            "LMCache is in DEGRADED MODE for the %s (%s failed: %s): nothing will be stored or loaded and every "
            "request is recomputed. Fix the cause above and restart.", role, stage, reason or "unknown error")
    return health


def engine_health() -> list[dict[str, Any]]:
    """Every role recorded in this process (empty when no connector was built here)."""
    with _lock:
        return [asdict(h) for h in _records.values()]


def is_degraded() -> bool:
    """True when any engine of this process runs in degraded mode."""
    with _lock:
        return any(h.degraded for h in _records.values())


def forget() -> None:
    """Drop every record (tests, or a connector rebuilt in the same process)."""
    with _lock:
        _records.clear()
