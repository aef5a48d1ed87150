"""Put the layout's key tags into every lookup the worker's LMCache engine answers.

Our connector adds a layout fingerprint to LMCache's keys (``lmcache.tag.*`` request configs), so a chunk
stored under another KV layout is never loaded into this one. Stores and loads pass the tag themselves, but
lookups come from vLLM's scheduler -- another process, which never sees the KV tensors and so cannot know
the fingerprint -- through LMCache's lookup server, which calls ``engine.lookup`` /
``engine.async_lookup_and_prefetch`` with the scheduler's request configs. Those two methods of the one
engine instance are wrapped to add the tags; a second call with the same tags changes nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

_MARK = "_lmcache_platforms_tags"
WRAPPED = ("lookup", "async_lookup_and_prefetch")


def with_tags(request_configs: Mapping[str, Any] | None, tags: Mapping[str, str]) -> dict[str, Any]:
    """``request_configs`` plus ``tags`` (ours win: a request cannot pick another layout's chunks)."""
    return {**(request_configs or {}), **tags}


def _tagged(method: Callable[..., Any], tags: dict[str, str]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, request_configs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        return method(*args, request_configs=with_tags(request_configs, tags), **kwargs)

    setattr(call, _MARK, tags)
    return call


def tag_engine_lookups(engine: Any, tags: Mapping[str, str]) -> None:
    """Make ``engine``'s lookups carry ``tags``; idempotent, and re-tagging replaces the old tags."""
    for name in WRAPPED:
        method = getattr(engine, name, None)
        if method is None:
            continue
        method = getattr(method, "__wrapped__", method) if hasattr(method, _MARK) else method
        setattr(engine, name, _tagged(method, dict(tags)))
