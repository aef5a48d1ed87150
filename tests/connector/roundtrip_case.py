"""One store -> wipe -> load -> compare cycle through a real LMCacheEngine, as the tests run it."""

from __future__ import annotations

from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib


def round_trip(layout: KVLayout, num_tokens: int, storage: StorageOptions | None = None, *,
               backend: str = "auto", layerwise: bool = False, layer_steps: int | None = None,
               seed: int = 0) -> dict:
    """The selftest summary of one cycle (``bit_exact``, ``rows_checked``, ``chunks_hit`` ...)."""
    request = roundtrip.make_request(layout, num_tokens, seed)
    storage = storage or StorageOptions(max_local_cpu_size=cache_size_gib(layout, num_tokens))
    with LayoutEngine(layout, storage, kernel_backend=backend, layerwise=layerwise,
                      layer_steps=layer_steps) as engine:
        return engine.round_trip(request, "case")
