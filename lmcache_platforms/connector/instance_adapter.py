"""Every change we make to a live LMCache object, in one module: which objects, which methods, in which order.

Class patches (``patching``) change LMCache for every engine in the process. These changes need one instance
instead, because they carry that instance's own state:

- the GPU connector's ``LMCacheMetadata`` describes our chunk format (``describe_chunks``): LMCache sizes each
  MemoryObj from ``get_shapes(num_tokens)`` and ``get_dtypes()`` before any connector code runs, and the remote
  backends read ``get_shapes()`` when they are created. Upstream derives those from one model-wide
  ``kv_shape``; ours come from the bound layout (rows per chunk do not depend on the token count: a partial
  chunk leaves rows unused). ``kv_shape`` and ``kv_dtype`` stay untouched: they are part of LMCache's keys;
- with chunks stored in parts, the engine's ``store`` and ``lookup`` move every part (``parts``);
- the engine's lookups carry the layout's key tags: they come from vLLM's scheduler (another process, which
  never sees the KV tensors) through LMCache's lookup server, with the scheduler's request configs.

``INSTANCE_CHANGES`` (``instance_changes``) declares them (``doctor`` lists them; ``patching.upstream_names`` checks
each name exists in the pinned LMCache). ``adapt_engine`` is the one place an engine's methods are replaced: its
first call keeps the instance's own methods, and every call builds the whole chain again from those (the parts,
then the key tags), so a second call, or one with other parts or tags, never wraps a wrapper. Loads do not go
through the engine's ``retrieve``: ``connector.chunk_loads`` reads the objects and hands them to the connector.

Which part a store moves reaches the metadata and the GPU connector through ``parts.active_part`` (a context
variable): LMCache's own calls in between carry no argument for it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from lmcache_platforms.connector.chunk_format import ChunkFormat
from lmcache_platforms.connector.instance_changes import (
    ENGINE,
    INSTANCE_CHANGES,
    METADATA_METHODS,
    TAGGED_METHODS,
)
from lmcache_platforms.connector.parts import current_part, parts_methods
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
        methods.update(parts_methods(engine, methods, parts, chunk_size))
    if lookup_tags:
        for name in TAGGED_METHODS:
            if name in methods:
                methods[name] = _tagged(methods[name], dict(lookup_tags))
    for name, method in methods.items():
        setattr(engine, name, method)


def describe_chunks(metadata: Any, fmt: ChunkFormat, parts: Sequence[ChunkFormat] = ()) -> None:
    """From now on ``metadata`` reports ``fmt``'s single-tensor shape and dtype for every chunk; with chunk
    ``parts``, the shape of the part being moved (``connector.parts.active_part``), and ``fmt``'s outside one
    (what the remote tiers see when they are created)."""

    def get_shapes(num_tokens: int | None = None) -> list[torch.Size]:
        index = current_part()
        return [fmt.shape if index is None or not parts else parts[index].shape]

    def get_dtypes() -> list[torch.dtype]:
        return [fmt.dtype]

    def get_num_groups() -> int:
        return 1

    metadata.get_shapes = get_shapes
    metadata.get_dtypes = get_dtypes
    metadata.get_num_groups = get_num_groups


def forget_chunks(metadata: Any) -> None:
    """Undo ``describe_chunks`` (the class methods apply again)."""
    for name in METADATA_METHODS:
        metadata.__dict__.pop(name, None)
