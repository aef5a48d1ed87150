"""LMCache's metadata reports our chunk shape on the instance only, and can be restored."""

from __future__ import annotations

import torch
from lmcache.v1.metadata import LMCacheMetadata

from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.connector.chunk_shapes import describe_chunks, forget_chunks
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools.fixtures import plan


def _metadata() -> LMCacheMetadata:
    return LMCacheMetadata(model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=torch.bfloat16, kv_shape=(4, 2, 64, 2, 64), chunk_size=64)


def test_describe_chunks_overrides_one_instance_and_keeps_the_key_fields() -> None:
    fmt = paged_format(plan(load_layout_spec("gemma3")))
    ours, other = _metadata(), _metadata()
    upstream_shapes = other.get_shapes()
    describe_chunks(ours, fmt)
    assert ours.get_shapes() == ours.get_shapes(17) == [fmt.shape]
    assert ours.get_dtypes() == [torch.uint8] and ours.get_num_groups() == 1
    assert other.get_shapes() == upstream_shapes
    assert ours == other  # LMCacheEngineBuilder compares metadata; kv_shape and kv_dtype are key fields
    forget_chunks(ours)
    assert ours.get_shapes() == upstream_shapes and ours.get_dtypes() == [torch.bfloat16]
