"""Layerwise LMCache connector over a KVLayout (``use_layerwise``), following upstream's generator protocol.

LMCache splits every chunk into ``metadata.kv_shape[0]`` per-layer keys and drives the connector one
"layer" at a time. Here a layer step is a contiguous run of the layout's layers (all their planes), so any
layout maps onto the engine's layer count; each step's MemoryObj holds that run's rows of every transfer
group, padded to the widest step because LMCache gives every layer object the same shape and dtype.

Store: ``batched_from_gpu(memory_objs[step][chunk], starts, ends, **kw)`` yields after queueing each step
and synchronizes that step on the next resume, before LMCache puts its objects; one extra final yield.
Load: ``batched_to_gpu(starts, ends, **kw)`` is primed with ``next``, then receives each step's objects with
``send``; a final ``next`` waits for the last step. Kwargs as in ``connector.request`` (``block_ids``,
``sync``).
Every step's object carries its own checksum (``connector.checksum``), checked before that step is written;
a mismatch raises ``ChecksumMismatch`` (LMCache's layerwise retrieve calls this connector itself), so that step
and the ones after it are never written.
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import VLLMPagedMemLayerwiseGPUConnector

from lmcache_platforms.connector.binding import BoundLayoutMixin, LayoutBinding, memory_obj_bytes
from lmcache_platforms.connector.checksum import ChecksumMismatch, format_version
from lmcache_platforms.connector.chunk_format import ChunkFormat, step_formats
from lmcache_platforms.connector.chunk_shapes import describe_chunks
from lmcache_platforms.connector.request import block_ids_from, check_chunk
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.parts import ChunkPart
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


class LayerwiseLayoutGPUConnector(BoundLayoutMixin, VLLMPagedMemLayerwiseGPUConnector):
    """Layerwise connector; it subclasses upstream's only because LMCacheEngine admits layerwise connectors
    by ``isinstance`` (``assert_layerwise_gpu_connector``). None of the parent's code or state is used."""

    connector_kind = "layerwise connector"

    def __init__(self, metadata: Any, kernel_backend: str = "auto") -> None:
        self.metadata = metadata
        self.kernel_backend = kernel_backend
        self.num_layers = int(metadata.kv_shape[0])
        self.binding: LayoutBinding | None = None
        self.formats: list[ChunkFormat] = []
        self.parts: tuple[ChunkPart, ...] = ()
        self.kvcaches = None

    def bind(self, layout: KVLayout, split: bool = False) -> None:
        """Attach the layout, cut into ``num_layers`` steps (the engine's layer count); chunks stay whole."""
        if split:
            raise TransferError("the layerwise connector stores chunks whole; chunk parts need the paged one")
        if len(layout.layers) < self.num_layers:
            raise TransferError(f"the engine splits chunks into {self.num_layers} layers but the layout has "
                                f"only {len(layout.layers)}; set kv_shape[0] to at most that")
        self.formats = step_formats(layout, self.num_layers, self.metadata.kv_dtype)
        self.binding = LayoutBinding(layout, self.formats, self.kernel_backend)
        describe_chunks(self.metadata, self.formats[0])
        logger.info("bound layout layerwise: %d steps of %d bytes, kernels %s, checksum %s, key tag %s",
                    self.num_layers, self.formats[0].nbytes, ",".join(self.binding.backend_names), format_version(),
                    self.binding.fingerprint)

    def get_shape(self, num_tokens: int) -> torch.Size:
        self._bound()
        return self.formats[0].shape

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        raise NotImplementedError("the layerwise connector only moves chunks through batched_to_gpu")

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        raise NotImplementedError("the layerwise connector only moves chunks through batched_from_gpu")

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
        """Generator: store step by step (see the module docstring for the yields)."""
        binding = self._bound()
        block_ids = block_ids_from(kwargs, binding.layout)
        for start, end in zip(starts, ends, strict=True):
            check_chunk(binding.layout, start, end)
        for step, fmt in enumerate(self.formats):
            hosts = [memory_obj_bytes(m, fmt, s, e) for m, s, e in zip(memory_objs[step], starts, ends, strict=True)]
            stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=True)
            with binding.streams.storing():
                binding.store_chunks(fmt, hosts, binding.chunk_slots(fmt, block_ids, starts, ends), stripes=stripes)
            yield
            binding.streams.finish_store()
            stripes.seal(hosts)
            binding.counters.count_groups(fmt, len(hosts), stored=True)
        binding.counters.chunks_stored += len(starts)
        yield

    def batched_to_gpu(self, starts, ends=None, **kwargs):
        """Generator: load step by step; each step's MemoryObjs arrive through ``send``."""
        binding = self._bound()
        block_ids = block_ids_from(kwargs, binding.layout)
        sync = bool(kwargs.get("sync", True))
        for step, fmt in enumerate(self.formats):
            memory_objs = yield
            if sync and step:
                binding.streams.mark_loaded()
            hosts = [memory_obj_bytes(m, fmt, s, e) for m, s, e in zip(memory_objs, starts, ends, strict=True)]
            corrupt = binding.load_verified(fmt, hosts, binding.chunk_slots(fmt, block_ids, starts, ends))
            if corrupt:
                raise ChecksumMismatch(f"layerwise step {step}: the stored objects of chunks "
                                       f"{[(starts[i], ends[i]) for i in corrupt]} fail their checksum")
            binding.counters.count_groups(fmt, len(hosts), stored=False)
        yield
        binding.streams.finish_load()
        binding.counters.chunks_loaded += len(starts)
        yield
