"""Make an ``LMCacheMetadata`` describe our chunks, so LMCache allocates them before calling the connector.

``LMCacheEngine.store`` sizes each chunk's MemoryObj from ``metadata.get_shapes(num_tokens)`` and
``get_dtypes()`` before any connector code runs, and the remote backends read ``get_shapes()`` when they are
created (``post_init``). Upstream derives those from one model-wide ``kv_shape``; we override them on the
instance (not the class, so other engines in the process keep theirs) with the bound layout's chunk shape,
which does not depend on the token count: rows per chunk come from the layout, and a partial chunk simply
leaves rows unused. ``kv_shape`` and ``kv_dtype`` stay untouched because they are part of LMCache's keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from lmcache_platforms.connector.chunk_format import ChunkFormat
from lmcache_platforms.connector.parts import current_part

_OVERRIDES = ("get_shapes", "get_dtypes", "get_num_groups")


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
    for name in _OVERRIDES:
        metadata.__dict__.pop(name, None)
