"""The changes we make to a live LMCache engine: which methods, in which order.

Class patches (``patching``) change LMCache for every engine in the process. These changes need one instance
instead, because they carry that instance's own state (the GPU connector's metadata is the other instance
change: ``chunk_shapes``):

- with chunks stored in parts, the engine's ``store`` goes through ``chunk_stores`` (for LMCache's own callers,
  its offload server: our worker and tools call ``chunk_stores`` directly) and its ``lookup`` finds every part
  (``parts``);
- the engine's lookups carry the layout's key tags: they come from vLLM's scheduler (another process, which
  never sees the KV tensors) through LMCache's lookup server, with the scheduler's request configs.

``INSTANCE_CHANGES`` (``instance_changes``) declares them (``doctor`` lists them; ``patching.upstream_names`` checks
each name exists in the pinned LMCache). ``adapt_engine`` is the one place an engine's methods are replaced: its
first call keeps the instance's own methods, and every call builds the whole chain again from those (the parts,
then the key tags), so a second call, or one with other parts or tags, never wraps a wrapper. Loads do not go
through the engine's ``retrieve``: ``connector.chunk_loads`` reads the objects and hands them to the connector.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from lmcache_platforms.connector import chunk_stores
from lmcache_platforms.connector.instance_changes import ENGINE, INSTANCE_CHANGES, TAGGED_METHODS
from lmcache_platforms.connector.parts import lookup_method
from lmcache_platforms.layout.parts import ChunkPart

# Every engine method some change replaces: adapt_engine keeps the instance's own once, and builds on them.
_ENGINE_METHODS = tuple(dict.fromkeys(m for c in INSTANCE_CHANGES if c.target == ENGINE for m in c.methods))
_ORIGINALS = "_lmcache_platforms_originals"


def with_tags(request_configs: Mapping[str, Any] | None, tags: Mapping[str, str]) -> dict[str, Any]:
    """``request_configs`` plus ``tags`` (ours win: a request cannot pick another layout's chunks)."""
    return {**(request_configs or {}), **tags}


def _tagged(method: Callable[..., Any], tags: dict[str, str]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, request_configs: Mapping[str, Any] | None = None, **kwargs: Any) -> Any:
        return method(*args, request_configs=with_tags(request_configs, tags), **kwargs)

    return call


def _store_method(engine: Any, method: Callable[..., Any]) -> Callable[..., Any]:
    """``engine``'s ``store``, as LMCache's callers call it, made a ``chunk_stores`` job."""

    @functools.wraps(method)
    def store(*args: Any, **kwargs: Any) -> None:
        chunk_stores.store(engine, chunk_stores.from_lmcache_arguments(*args, **kwargs))

    return store


def adapt_engine(engine: Any, parts: Sequence[ChunkPart] = (), chunk_size: int = 0,
                 lookup_tags: Mapping[str, str] | None = None) -> None:
    """Make ``engine`` store and look up ``parts`` (with ``chunk_size``-token chunks), and tag its lookups with
    ``lookup_tags``: built from the instance's own methods each time, so calling again replaces."""
    originals: dict[str, Callable[..., Any]] | None = engine.__dict__.get(_ORIGINALS)
    if originals is None:
        originals = {name: getattr(engine, name) for name in _ENGINE_METHODS if hasattr(engine, name)}
        engine.__dict__[_ORIGINALS] = originals
    methods = dict(originals)
    if parts:
        methods["store"] = _store_method(engine, methods["store"])
        methods["lookup"] = lookup_method(engine, methods["lookup"], parts, chunk_size)
    if lookup_tags:
        for name in TAGGED_METHODS:
            if name in methods:
                methods[name] = _tagged(methods[name], dict(lookup_tags))
    for name, method in methods.items():
        setattr(engine, name, method)

