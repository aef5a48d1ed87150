"""What LMCache's storage tiers do for one engine, told to whoever listens: the objects a local tier drops, and
the objects a load reads from each tier.

LMCache 0.5.6 tells only its optional cache controller when its local CPU or disk backend drops an object, and
nobody which tier served a load. A KV-aware router needs the first (a server that evicted a prefix should stop
being sent the requests sharing it: ``integration.vllm.kv_events`` publishes ``BlockRemoved``), a dashboard the
second (bytes read per tier). Every eviction and forced removal of both local backends goes through their
``remove``, and every read of a retrieve through the storage manager's ``batched_get`` with the tier's name; the
patch catalog wraps both (``wrap_remove``, ``wrap_batched_get``), and a listener is registered for one backend
or storage manager instance (``listen``), so engines nobody listens to pay nothing. The listeners are kept here,
beside the LMCache objects (weakly: they go with the object), not on them.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

_listeners: weakref.WeakKeyDictionary[Any, dict[str, Callable[..., None]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _tell(target: Any, *news: Any) -> None:
    for owner, listener in tuple(_listeners.get(target, {}).items()):
        try:
            listener(*news)
        except Exception:  # a lost notice must not fail LMCache's own work
            logger.exception("tier listener %s failed for %s", owner, news)


def wrap_remove(upstream: Callable[..., bool]) -> Callable[..., bool]:
    """Patch-catalog wrapper of a local backend's ``remove``: after a removal, each listener gets the key."""

    def remove(self: Any, key: Any, *args: Any, **kwargs: Any) -> bool:
        removed = upstream(self, key, *args, **kwargs)
        if removed:
            _tell(self, key)
        return removed

    return remove


def wrap_batched_get(upstream: Callable[..., list[Any]]) -> Callable[..., list[Any]]:
    """Patch-catalog wrapper of ``StorageManager.batched_get``: after a read from a named tier, each listener gets
    the tier's name and the objects read (None where a key was not found)."""

    def batched_get(self: Any, keys: Any, location: str | None = None, *args: Any, **kwargs: Any) -> list[Any]:
        objects = upstream(self, keys, location, *args, **kwargs)
        if location is not None and objects:
            _tell(self, location, objects)
        return objects

    return batched_get


def listen(target: Any, owner: str, listener: Callable[..., None]) -> None:
    """Tell ``listener`` what ``target`` (a local backend: ``listener(key)``; a storage manager:
    ``listener(tier, objects)``) does; one listener per ``owner`` (a second call with the same owner replaces)."""
    with _lock:
        _listeners[target] = {**_listeners.get(target, {}), owner: listener}
