"""What one engine's ``LMCacheMetadata`` reports of our chunks (``instance_changes`` declares the change).

LMCache sizes each MemoryObj its own store allocates from ``get_shapes(num_tokens)`` and ``get_dtypes()`` before
any connector code runs, and the remote backends read ``get_shapes()`` when they are created. Upstream derives
those from one model-wide ``kv_shape``; ours come from the bound layout's chunk format (rows per chunk do not
depend on the token count: a partial chunk leaves rows unused). ``kv_shape`` and ``kv_dtype`` stay untouched:
they are part of LMCache's keys. Chunks stored in parts are allocated by ``connector.chunk_stores`` in each part's
own shape, so the metadata only ever describes whole chunks.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcache_platforms.connector.chunk_format import ChunkFormat
from lmcache_platforms.connector.instance_changes import METADATA_METHODS


def describe_chunks(metadata: Any, fmt: ChunkFormat) -> None:
    """From now on ``metadata`` reports ``fmt``'s single-tensor shape and dtype for every chunk."""

    def get_shapes(num_tokens: int | None = None) -> list[torch.Size]:
        return [fmt.shape]

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
