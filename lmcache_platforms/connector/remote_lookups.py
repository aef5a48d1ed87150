"""What the remote-lookup guard (``upstream_fixes.remote_lookup``) counts, and where the vLLM integration finds it.

The guard sits on LMCache's remote backend, one per backend, under ``GUARD_ATTRIBUTE``; the integration (a
layer below the fixes) reads its counts from there for the connector statistics, through this protocol, without
importing the fixes.
"""

from __future__ import annotations

from typing import Any, Protocol

GUARD_ATTRIBUTE = "_lmcache_platforms_lookup_guard"


class RemoteLookupCounts(Protocol):
    """Counts since the guard was made: asks the store did not answer in time, asks skipped after that."""

    timed_out: int
    skipped: int


def remote_lookup_counts(engine: Any) -> tuple[int, int]:
    """(timed out, skipped) summed over the remote backends of LMCache ``engine`` that have a guard."""
    backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", None) or {}
    guards: list[RemoteLookupCounts] = [guard for backend in backends.values()
                                        if (guard := getattr(backend, GUARD_ATTRIBUTE, None)) is not None]
    return sum(guard.timed_out for guard in guards), sum(guard.skipped for guard in guards)
