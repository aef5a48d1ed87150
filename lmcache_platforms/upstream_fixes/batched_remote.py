"""LMCache's batched remote reads and lookups, given to the connectors that ask one object at a time.

LMCache 0.5.6's remote backend reads a load's objects with one ``batched_get`` and answers a lookup with one
``batched_contains`` when its connector announces them (``support_batched_get``,
``support_batched_contains``); otherwise it asks the connector object by object. Its Redis, Redis Cluster and
``fs://`` connectors announce neither, so each object cost its own round trips (Redis) or thread hand-offs
(``fs://``). These wrappers of the base class announce and route both for those connectors
(``redis_reads``, ``fs_reads``) and keep upstream's answer for every other connector.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lmcache_platforms.upstream_fixes import fs_reads, redis_reads


def _batched(connector: Any) -> tuple[Callable[..., Any], Callable[..., int]] | None:
    """(batched_get, batched_contains) for a connector this package batches, else None."""
    if redis_reads.redis_client(connector) is not None:
        return redis_reads.batched_get, redis_reads.batched_contains
    if fs_reads.is_fs(connector):
        return fs_reads.batched_get, fs_reads.batched_contains
    return None


def wrap_supports_batched(upstream: Any) -> Any:
    """Wrapper of ``RemoteConnector.support_batched_get`` and ``support_batched_contains``."""

    def supported(self: Any) -> bool:
        return _batched(self) is not None or upstream(self)

    return supported


def wrap_batched_get(upstream: Any) -> Any:
    """Wrapper of ``RemoteConnector.batched_get``: the objects of ``keys``, None where one cannot be had."""

    async def batched_get(self: Any, keys: list[Any]) -> list[Any]:
        batched = _batched(self)
        return await (upstream(self, keys) if batched is None else batched[0](self, keys))

    return batched_get


def wrap_batched_contains(upstream: Any) -> Any:
    """Wrapper of ``RemoteConnector.batched_contains`` (synchronous, called off the connector's loop): how many
    of ``keys``, from the first, the store holds."""

    def batched_contains(self: Any, keys: list[Any]) -> int:
        batched = _batched(self)
        return upstream(self, keys) if batched is None else batched[1](self, keys)

    return batched_contains
