"""LMCache GPU connector for any KV layout: every transfer group of a chunk in one MemoryObj, or (``split``)
one MemoryObj per chunk part (``connector.parts``).

Per chunk and direction it makes one kernel call per transfer group (``launches_per_chunk``; on a device, one
call per transfer group moves a whole batch of chunks staged in scratch, ``LayoutBinding.store_chunks``, whole
or one layer at a time); every object carries a checksum of its bytes, written by the store and checked by a
load before anything may read the rows (``connector.checksum``). Loads come as objects already read
(``load_objects``, called by ``connector.chunk_loads``, which gets the corrupt ones' indices back); LMCache's own
retrieve still reaches ``batched_to_gpu``. Rows per chunk come from the layout (sliding-window tails, compressed
rows), never from the token count. The kwargs LMCache's store and retrieve pass are documented in
``lmcache_platforms.connector.request``. The layout is bound lazily (``bind``) when the KV caches are
registered, which must happen before the engine's ``post_init`` and the first store.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface

from lmcache_platforms.connector.binding import BoundLayoutMixin, LayoutBinding, memory_obj_bytes
from lmcache_platforms.connector.checksum import ChecksumMismatch, format_version
from lmcache_platforms.connector.chunk_format import ChunkFormat, paged_format
from lmcache_platforms.connector.chunk_shapes import describe_chunks
from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.connector.request import LAYER_GATE, block_ids_from, block_tables, check_chunk, run_guarded
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.parts import ChunkPart, chunk_parts
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


class LayoutGPUConnector(BoundLayoutMixin, GPUConnectorInterface):
    """Paged (non-layerwise) connector over a KVLayout and the kernel backends the registry picks."""

    def __init__(self, metadata: Any = None, kernel_backend: str = "auto") -> None:
        self.metadata = metadata
        self.kernel_backend = kernel_backend
        self.binding: LayoutBinding | None = None
        self.fmt: ChunkFormat | None = None
        self.parts: tuple[ChunkPart, ...] = ()
        self.part_formats: tuple[ChunkFormat, ...] = ()
        self.kvcaches = None

    def bind(self, layout: KVLayout, split: bool = False) -> None:
        """Attach the KV caches' layout: chunk format, kernels, streams; teach the metadata our chunk shape.

        With ``split``, a layout with window or snapshot groups beside full attention stores each chunk as
        one object per part (``connector.parts``); the engine must then be adapted to them
        (``instance_adapter.adapt_engine``).
        """
        fmt = paged_format(layout)
        parts = chunk_parts(layout) if split else ()
        if len(parts) < 2:
            parts = ()
        part_formats = tuple(paged_format(layout, part.transfer_groups) for part in parts)
        self.binding = LayoutBinding(layout, part_formats or [fmt], self.kernel_backend)
        self.fmt, self.parts, self.part_formats = fmt, parts, part_formats
        if self.metadata is not None:
            describe_chunks(self.metadata, fmt)
        logger.info(
            "bound layout: %d transfer groups, %d bytes per chunk (%s mode)%s, kernels %s, checksum %s, key tag %s "
            "(chunks stored under another format or checksum have other keys and miss)",
            len(layout.transfer_groups), fmt.payload_bytes, layout.mode,
            "".join(f", part {p.name} {f.payload_bytes} bytes" for p, f in zip(parts, part_formats, strict=True)),
            ",".join(self.binding.backend_names), format_version(), self.binding.fingerprint,
        )

    def part_format(self, part: int | None) -> ChunkFormat:
        """The format of what is being moved: the whole chunk, or part ``part`` of it."""
        self._bound()
        assert self.fmt is not None
        if not self.parts:
            return self.fmt
        if part is None:
            raise TransferError("this layout stores chunks in parts: store through connector.chunk_stores (the "
                                "engine's store, as connector.instance_adapter adapts it), load through "
                                "connector.chunk_loads")
        return self.part_formats[part]

    def counts_chunks(self, part: int | None) -> bool:
        """Chunks are counted once, when their widest part (the first) moves; bytes for every part."""
        return not self.parts or part == 0

    def get_shape(self, num_tokens: int) -> torch.Size:
        return self.part_format(None).shape

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        """LMCache's own store (chunks stored whole): KV caches -> MemoryObjs (``store_objects``)."""
        self.store_objects(None, memory_objs, starts, ends, block_ids_from(kwargs, self._bound().layout),
                           kwargs.get(LAYER_GATE))

    def store_objects(self, part: int | None, memory_objs: Sequence[Any], starts: Sequence[int],
                      ends: Sequence[int], block_ids: Sequence[Any], gate: LayerGate | None = None) -> None:
        """KV caches -> MemoryObjs of part ``part`` (None: whole chunks), one chunk per object, each sealed with
        its checksum; returns once the bytes are in host memory. With a ``gate``, layer by layer as the forward
        marks them written."""
        binding = self._bound()
        fmt = self.part_format(part)
        ids = block_tables(block_ids, binding.layout)
        for start, end in zip(starts, ends, strict=True):
            check_chunk(binding.layout, start, end)
        hosts = [memory_obj_bytes(m, fmt, s, e) for m, s, e in zip(memory_objs, starts, ends, strict=True)]
        slots = binding.chunk_slots(fmt, ids, starts, ends)
        stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=gate is None)
        with binding.streams.storing():
            if gate is None:
                binding.store_chunks(fmt, hosts, slots, stripes=stripes)
            else:
                cut = dict(binding.layer_launches(fmt))
                for layer, event in gate.as_marked(list(cut)):
                    binding.streams.store_after(event)
                    binding.store_chunks(fmt, hosts, slots, cut[layer], stripes)
                    binding.counters.layers_stored += 1
        binding.streams.finish_store()
        stripes.seal(hosts)
        binding.counters.chunks_stored += len(hosts) if self.counts_chunks(part) else 0
        binding.counters.bytes_stored += len(hosts) * fmt.nbytes
        binding.counters.count_groups(fmt, len(hosts), stored=True)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        """LMCache's own retrieve (the modes where LMCache's engine brings the objects itself: its asynchronous
        loading, an MLA rank's broadcast, a PD receiver): MemoryObjs -> KV caches inside the ``load_guard``. A
        corrupt object raises ``ChecksumMismatch`` (the guard records it: the load failed)."""
        binding = self._bound()
        block_ids = block_ids_from(kwargs, binding.layout)

        def write() -> None:
            corrupt = self.load_objects(None, memory_objs, starts, ends, block_ids, kwargs.get(LAYER_GATE))
            if corrupt:
                chunks = ", ".join(f"[{starts[i]}, {ends[i]})" for i in corrupt)
                raise ChecksumMismatch(f"the stored object of chunk {chunks} fails its checksum: the load failed, "
                                       "no byte that failed the check is left in the KV cache")

        run_guarded(kwargs, write)

    def load_objects(self, part: int | None, memory_objs: Sequence[Any], starts: Sequence[int], ends: Sequence[int],
                     block_ids: Sequence[torch.Tensor], gate: LayerGate | None = None) -> list[int]:
        """MemoryObjs of part ``part`` (None: whole chunks) -> KV caches; returns once the compute stream will see
        the rows, with the indices of objects that failed their checksum (their rows zeroed or never written:
        ``LayoutBinding.load_verified``), [] when every one was written. With a ``gate``, layer by layer in the
        layout's order, marking each as its rows are written (or queued).

        The size check runs here too: a wrong-size object (a backend's garbage that parsed, a chunk of another
        layout) raises ``TransferError`` before anything is written."""
        binding = self._bound()
        fmt = self.part_format(part)
        hosts = [memory_obj_bytes(m, fmt, s, e) for m, s, e in zip(memory_objs, starts, ends, strict=True)]
        slots = binding.chunk_slots(fmt, block_ids, starts, ends)
        corrupt = binding.load_verified(fmt, hosts, slots) if gate is None else load_by_layer(
            binding, fmt, hosts, slots, gate)
        if corrupt:
            binding.counters.objects_corrupt += len(corrupt)
            return corrupt
        binding.streams.finish_load()
        binding.counters.chunks_loaded += len(hosts) if self.counts_chunks(part) else 0
        binding.counters.bytes_loaded += len(hosts) * fmt.nbytes
        binding.counters.count_groups(fmt, len(hosts), stored=False)
        return []


def load_by_layer(binding: LayoutBinding, fmt: ChunkFormat, hosts: list[torch.Tensor],
                  slots: Mapping[int, torch.Tensor], gate: LayerGate) -> list[int]:
    """Every object's pieces layer by layer, marking each layer in ``gate`` once written; the indices of corrupt
    objects, or []. Host objects are checked stripe by stripe as each layer is written (``integrity.open_layers``),
    so a mismatch can stop the load after earlier layers were marked: those hold verified bytes, and the failed
    load's blocks are recomputed. Otherwise every object is checked before the first layer."""
    checks = binding.integrity.open_layers(fmt.payload_bytes, hosts)
    if checks.corrupt:
        return checks.corrupt
    with binding.streams.loading():
        gate.begin_pass()
        for layer, launches in binding.layer_launches(fmt):
            if corrupt := binding.load_chunks(fmt, hosts, slots, launches, checks):
                return corrupt
            gate.mark(layer, binding.streams.load_event())
            binding.counters.layers_loaded += 1
    return checks.unmatched()
