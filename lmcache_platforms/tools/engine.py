"""A real ``LMCacheEngine`` driving our connector over a bound layout, outside vLLM (selftest, tests).

This is the same path vLLM takes (the engine allocates MemoryObjs from the metadata, then calls the
connector), minus the scheduler: callers pass tokens and per-group block ids themselves.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.tools import roundtrip

if TYPE_CHECKING:
    from lmcache_platforms.connector.layer_gate import LayerGate


@dataclass(frozen=True)
class StorageOptions:
    """Which LMCache storage backends the engine gets (sizes in GiB, as LMCache's config takes them)."""

    local_cpu: bool = True
    max_local_cpu_size: float = 0.5
    local_disk: str | None = None
    max_local_disk_size: float = 0.0
    remote_url: str | None = None


def cache_size_gib(layout: KVLayout, num_tokens: int) -> float:
    """A CPU cache (GiB) twice the size of ``num_tokens`` tokens' chunks: LMCache allocates it up front."""
    chunks = -(-num_tokens // layout.chunk_size)
    return (2 * chunks * max(layout.chunk_bytes, 1) + 2**24) / 2**30


def engine_config(chunk_size: int, storage: StorageOptions, *, layerwise: bool = False,
                  save_unfull_chunk: bool = False) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    disk = storage.local_disk
    return LMCacheEngineConfig.from_defaults(
        chunk_size=chunk_size,
        local_cpu=storage.local_cpu,
        max_local_cpu_size=storage.max_local_cpu_size,
        local_disk=None if disk is None else (disk if disk.endswith("/") else disk + "/"),
        max_local_disk_size=storage.max_local_disk_size,
        remote_url=storage.remote_url,
        remote_serde="naive",
        use_layerwise=layerwise,
        save_unfull_chunk=save_unfull_chunk,
    )


def engine_metadata(layout: KVLayout, model_name: str, num_layers: int) -> Any:
    """Metadata as vLLM's adapter would build it; ``num_layers`` is what the engine splits layerwise keys by."""
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name=model_name, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
        kv_dtype=torch.uint8, kv_shape=(num_layers, 2, layout.chunk_size, 1, 1), chunk_size=layout.chunk_size,
    )


_ids = itertools.count()


class LayoutEngine:
    """An LMCacheEngine whose connector is bound to ``layout``; ``close`` destroys it (use ``with``)."""

    def __init__(self, layout: KVLayout, storage: StorageOptions, *, kernel_backend: str = "auto",
                 layerwise: bool = False, layer_steps: int | None = None,
                 model_name: str = "lmcache-platforms-selftest") -> None:
        os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        from lmcache_platforms.connector.instance_adapter import adapt_engine
        from lmcache_platforms.connector.layerwise import LayerwiseLayoutGPUConnector
        from lmcache_platforms.connector.paged import LayoutGPUConnector

        self.layout = layout
        self.layerwise = layerwise
        self.metadata = engine_metadata(layout, model_name, layer_steps or len(layout.layers))
        config = engine_config(layout.chunk_size, storage, layerwise=layerwise,
                               save_unfull_chunk=not layout.whole_chunks_only)
        connector_class = LayerwiseLayoutGPUConnector if layerwise else LayoutGPUConnector
        self.connector = connector_class(self.metadata, kernel_backend)
        self.connector.bind(layout)
        self.instance_id = f"lmcache-platforms-{os.getpid()}-{next(_ids)}"
        self.engine = LMCacheEngineBuilder.get_or_create(self.instance_id, config, self.metadata,
                                                         self.connector, None, None)
        self.engine.post_init()
        adapt_engine(self.engine)

    @property
    def tags(self) -> dict[str, str]:
        assert self.connector.binding is not None
        return self.connector.binding.key_tags

    def store(self, tokens: list[int], block_ids: list[torch.Tensor], gate: LayerGate | None = None) -> None:
        """Store every chunk of ``tokens``; with ``gate``, layer by layer as it marks them written."""
        if self.layerwise:
            for _ in self.engine.store_layer(torch.tensor(tokens), sync=True, block_ids=block_ids,
                                             request_configs=self.tags):
                pass
            return
        from lmcache_platforms.connector.chunk_stores import StoreJob
        from lmcache_platforms.connector.chunk_stores import store as store_chunks

        job = StoreJob(req_id=f"store-{uuid.uuid4().hex[:8]}", tokens=torch.tensor(tokens), block_ids=block_ids,
                       request_configs=self.tags, gate=gate)
        store_chunks(self.engine, job)

    def lookup(self, tokens: list[int], search_range: list[str] | None = None) -> int:
        return self.engine.lookup(torch.tensor(tokens), search_range=search_range, request_configs=self.tags)

    def wait_stored(self, tokens: list[int], expected: int, timeout: float = 30.0,
                    search_range: list[str] | None = None) -> int:
        """Poll ``lookup`` until ``expected`` tokens are findable (disk and remote puts are asynchronous)."""
        deadline = time.monotonic() + timeout
        found = self.lookup(tokens, search_range)
        while found < expected and time.monotonic() < deadline:
            time.sleep(0.05)
            found = self.lookup(tokens, search_range)
        return found

    def retrieve(self, tokens: list[int], block_ids: list[torch.Tensor], gate: LayerGate | None = None) -> int:
        """Look up (pinning), load what hits into the planes, unpin; the number of tokens loaded. With ``gate``,
        layer by layer, marking each layer in it (``connector.layer_gate``)."""
        request_id = f"req-{uuid.uuid4().hex[:8]}"
        # retrieve_layer releases its own pins; pinning at lookup as well would unpin twice.
        found = self.engine.lookup(torch.tensor(tokens), lookup_id=request_id, pin=not self.layerwise,
                                   request_configs=self.tags)
        if self.layerwise:
            if not found:
                return 0  # LMCache 0.5.6's retrieve_layer raises UnboundLocalError when nothing hits
            # The generator's last value is the hit mask; the ones before are progress markers.
            *_, mask = self.engine.retrieve_layer(torch.tensor(tokens), sync=True, block_ids=block_ids,
                                                  request_configs=self.tags, req_id=request_id)
            return int(mask.sum())
        from lmcache_platforms.connector.chunk_loads import LoadJob
        from lmcache_platforms.connector.chunk_loads import load as load_chunks

        try:
            job = LoadJob(req_id=request_id, tokens=torch.tensor(tokens), block_ids=block_ids,
                          request_configs=self.tags, gate=gate)
            return load_chunks(self.engine, job).tokens
        finally:
            self.engine.lookup_unpin(request_id)

    def round_trip(self, request: roundtrip.Request, name: str) -> dict[str, Any]:
        """Store ``request``, wipe the planes, load it back into its other blocks: the selftest summary."""
        stored = roundtrip.snapshot(self.layout, request)
        self.store(request.tokens, request.store_ids)
        self.wait_stored(request.tokens, request.stored_tokens)
        roundtrip.zero_planes(self.layout)
        hit = self.retrieve(request.tokens, request.load_ids)
        verdict = roundtrip.verify(self.layout, request, stored, hit)
        assert self.connector.binding is not None
        return roundtrip.summary(self.layout, request, verdict, hit, self.connector.binding.counters, name)

    def close(self) -> None:
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        LMCacheEngineBuilder.destroy(self.instance_id)

    def __enter__(self) -> LayoutEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
