"""What a connector knows once the KV caches exist: the layout, its chunk formats, kernels and streams.

Both connectors (paged and layerwise) exist from engine creation but only learn the layout when vLLM
registers its KV caches, so everything layout-dependent lives here and is built by ``bind``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_platforms.connector.chunk_format import LAYOUT_TAG, ChunkFormat, Launch, layer_launches, layout_fingerprint
from lmcache_platforms.connector.integrity import LayerChecks, LoadCheck, ObjectIntegrity, StoreStripes
from lmcache_platforms.connector.streams import Scratch, TransferStreams, platform_for
from lmcache_platforms.kernels.contract import Direction, KernelBackend, TransferError
from lmcache_platforms.kernels.crc32c import ObjectCheck, ObjectStripes
from lmcache_platforms.kernels.registry import select_backend
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

# Device scratch a batch of chunks is staged through (per direction): each launch moves as many chunks as fit,
# at least one. vLLM sized its KV cache without it, so it stays small next to GPU memory.
BATCH_SCRATCH_BYTES = 64 << 20
# A load hashes the objects that crossed into the scratch in runs of at least this many bytes, each while the
# next ones cross: 4 MiB take the bus about 75 us, several launches' worth, so the runs cost no launch time.
HASH_RUN_BYTES = 4 << 20


def batch_runs(chunks: int, chunk_bytes: int) -> Iterator[tuple[int, int]]:
    """(first chunk, chunk count) of each scratch-full when ``chunks`` chunks of ``chunk_bytes`` are staged."""
    step = max(1, BATCH_SCRATCH_BYTES // chunk_bytes)
    for first in range(0, chunks, step):
        yield first, min(step, chunks - first)


def layout_device(layout: KVLayout) -> torch.device:
    """The one device every saved plane lives on."""
    devices = {p.storage.device for tg in layout.transfer_groups for p in tg.planes if p.storage is not None}
    if len(devices) > 1:
        raise TransferError(f"the layout's planes live on several devices: {sorted(map(str, devices))}")
    if any(p.storage is None for tg in layout.transfer_groups for p in tg.planes):
        raise TransferError("the layout has planes without tensors (a plan, not KV caches)")
    return devices.pop() if devices else torch.device("cpu")


def memory_obj_bytes(memory_obj, fmt: ChunkFormat, start: int, end: int) -> torch.Tensor:
    """The MemoryObj's bytes as a flat uint8 tensor, after checking they have this layout's size."""
    tensor = memory_obj.tensor
    if tensor is None:
        raise TransferError(f"the MemoryObj of chunk [{start}, {end}) is invalidated")
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel() != fmt.nbytes:
        raise TransferError(
            f"the MemoryObj of chunk [{start}, {end}) holds {flat.numel()} bytes, this layout's chunks "
            f"{fmt.nbytes} (shape {list(fmt.shape)}, {fmt.dtype}): it was stored with another layout"
        )
    return flat


@dataclass
class TransferCounters:
    """What went through the connector (selftest and tests read it)."""

    # Chunks (one count per chunk whatever its number of parts).
    chunks_stored: int = 0
    chunks_loaded: int = 0
    # MemoryObj bytes written by stores and read by loads (padding included): what the tiers hold and serve.
    bytes_stored: int = 0
    bytes_loaded: int = 0
    # Transfer-group moves, one per chunk and launch of its format (a backend may make a batch's in one call).
    launches: int = 0
    # Chunk objects a load refused because their checksum did not match (nothing of their batch was written).
    objects_corrupt: int = 0
    # Layerwise mode: one count per layer a store or load call moved on its own (``LayerGate``).
    layers_stored: int = 0
    layers_loaded: int = 0
    backends: set[str] = field(default_factory=set)
    # Payload bytes by vLLM KV-cache group index (each object's share of it; no trailer, no padding).
    group_bytes_stored: dict[int, int] = field(default_factory=dict)
    group_bytes_loaded: dict[int, int] = field(default_factory=dict)

    def count_groups(self, fmt: ChunkFormat, objects: int, stored: bool) -> None:
        """``objects`` objects of ``fmt`` moved: their bytes, group by group."""
        add_group_bytes(self.group_bytes_stored if stored else self.group_bytes_loaded, fmt, objects)


def add_group_bytes(totals: dict[int, int], fmt: ChunkFormat, objects: int) -> None:
    """Add the payload bytes of ``objects`` objects of ``fmt`` to ``totals``, by vLLM KV-cache group index."""
    for launch in fmt.launches:
        totals[launch.tg.group] = totals.get(launch.tg.group, 0) + objects * launch.nbytes


class LayoutBinding:
    """Moves chunks between a bound layout's planes and MemoryObjs, one kernel call per launch."""

    def __init__(self, layout: KVLayout, formats: Sequence[ChunkFormat], kernel_backend: str = "auto") -> None:
        self.layout = layout
        self.formats = tuple(formats)
        self.device = layout_device(layout)
        self.fingerprint = layout_fingerprint(self.formats)
        platform = platform_for(self.device)
        self.streams = TransferStreams(platform)
        # Kernels write device memory, then one copy per chunk crosses to the host on the transfer stream:
        # whenever the memory is not plain host memory or the platform has streams (the same thing, except
        # where a test's fake runtime claims an accelerator for CPU tensors).
        staged = self.device.type != "cpu" or bool(platform.torch_module_name)
        self.scratch = {d: Scratch(self.device) for d in Direction} if staged else {}
        self.integrity = ObjectIntegrity(self.device, platform.name, staged)
        """How this binding's objects are hashed and verified (``connector.integrity``)."""
        # Keyed by the identity of each launch's plane tuple (held by self.formats): hashing planes per call
        # would cost more than the lookup saves.
        self._backends: dict[int, KernelBackend] = {
            id(launch.planes): select_backend(launch.planes, self.device, kernel_backend)
            for fmt in self.formats for launch in fmt.launches
        }
        self._layer_launches: dict[str, tuple[tuple[str, tuple[Launch, ...]], ...]] = {}
        moved = {p.layer for tg in layout.transfer_groups for p in tg.planes}
        self.moved_layers = tuple(name for name in layout.model_layers if name in moved)
        """The model's layers with planes this binding moves, in order (a layer with only unsaved state planes
        is not one): what a ``LayerGate`` for its transfers covers."""
        self.counters = TransferCounters()
        # Why the planes' memory may not be touched now (vLLM's sleep mode unmaps it); None: it may.
        self.released: str | None = None

    def release(self, why: str) -> None:
        """Refuse every transfer from now on, then wait for the copies already queued on the transfer streams:
        the memory behind the planes is about to be unmapped, and a late copy would fault or read garbage."""
        self.released = why
        for stream in (self.streams.store_stream, self.streams.load_stream):
            if stream is not None:
                stream.synchronize()

    def reacquire(self) -> None:
        """Allow transfers again; the caller has checked the planes' memory is back at the same addresses."""
        self.released = None

    def _check_usable(self) -> None:
        """The backstop for paths that do not go through the vLLM connector (LMCache's offload server)."""
        if self.released is not None:
            raise TransferError(f"the KV caches behind this layout are released ({self.released}); no store or "
                                "load may touch them until they are restored")

    @property
    def backend_names(self) -> list[str]:
        return sorted({b.name for b in self._backends.values()})

    @property
    def key_tags(self) -> dict[str, str]:
        """``request_configs`` entries that put the layout into LMCache's keys (pass them to every call)."""
        return {LAYOUT_TAG: self.fingerprint}

    def chunk_slots(self, fmt: ChunkFormat, block_ids: Sequence[torch.Tensor], starts: Sequence[int],
                    ends: Sequence[int]) -> dict[int, torch.Tensor]:
        """The slots of every group ``fmt`` moves (by group index) for the chunks ``[starts[i], ends[i])``,
        ``[chunks, rows]`` each, made in one pass per group. They stay in host memory whatever the KV caches'
        device: each kernel backend checks them there and copies them across itself, where checking them on
        the device would wait for it at every launch (measured on an H200: a store ran at 2% of a device
        copy). Off CPU they are pinned, or each copy from pageable memory would wait for the launches queued
        before it."""
        bounds = list(zip(starts, ends, strict=True))
        table = {group: self.layout.group_chunks_slots(group, block_ids, bounds)
                 for group in dict.fromkeys(launch.tg.group for launch in fmt.launches)}
        if self.device.type != "cpu":
            table = {group: slots.pin_memory() for group, slots in table.items()}
        return table

    def layer_launches(self, fmt: ChunkFormat) -> tuple[tuple[str, tuple[Launch, ...]], ...]:
        """``fmt``'s launches cut by layer, in the layout's layer order (``chunk_format.layer_launches``)."""
        cut = self._layer_launches.get(fmt.fingerprint)
        if cut is None:
            cut = layer_launches(fmt, self.layout.model_layers)
            for _, pieces in cut:  # each piece runs on the kernel chosen for the launch it is cut from
                for piece in pieces:
                    whole = next(w for w in fmt.launches if w.offset <= piece.offset < w.offset + w.nbytes)
                    self._backends[id(piece.planes)] = self._backends[id(whole.planes)]
            self._layer_launches[fmt.fingerprint] = cut
        return cut

    def store_chunks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                     launches: Sequence[Launch] | None = None, stripes: StoreStripes | None = None) -> None:
        """Planes -> every object of ``hosts`` (the MemoryObjs' bytes; ``slots`` from ``chunk_slots``); call
        inside ``streams.storing()``, then ``stripes.seal`` once the store stream is finished. ``launches``: some
        of ``fmt``'s bytes only (one layer's, ``layer_launches``). ``stripes`` (``integrity.store_stripes``): what
        the kernels hash into as they copy host objects, or (whole chunks) the room the device's CRCs are read back
        into. Staged through device scratch, each launch moves a scratch-full of chunks at once (see
        ``BATCH_SCRATCH_BYTES``), then each chunk's bytes cross to its object, hashed there on a side stream."""
        self._move_chunks(fmt, hosts, slots, Direction.STORE, launches, stripes=stripes)

    def load_chunks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                    launches: Sequence[Launch], checks: LayerChecks | None = None) -> list[int]:
        """One layer's pieces (``layer_launches``) of every object of ``hosts`` -> planes; call inside
        ``streams.loading()``. With ``checks`` (``integrity.open_layers``) holding stripe checks, each piece writes
        only rows whose stripes match the CRCs its object carries: [], or at the first mismatch the indices of the
        corrupt objects (that one, and every other whose stripes do not all match; the load stops, earlier layers
        stay written with verified bytes). Without, the objects were checked whole already. Staged through device
        scratch: each chunk's piece crosses first, then each launch moves a scratch-full."""
        if checks is None or checks.checks is None:
            self._move_chunks(fmt, hosts, slots, Direction.LOAD, launches)
            return []
        self._check_usable()
        for index, host in enumerate(hosts):
            if not self._load_launches(launches, host, slots, index, checks.checks[index]):
                return [index] + [other for other in checks.unmatched() if other != index]
        return []

    def load_verified(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor],
                      slots: Mapping[int, torch.Tensor]) -> list[int]:
        """Loads the objects of ``hosts`` whole and checks them (``integrity.open_load``); returns the indices of
        those whose bytes do not match their checksum, before anything may read the rows: the caller then fails
        the load, and vLLM recomputes over the rows, so no request is answered from them. Hashed in the copy, a
        corrupt object's rows are written before the verdict, then zeroed (``_scrub``); hashed on the device, each
        scratch-full is compared before its own launches (the CRCs of each run of objects made on a side stream
        while the next ones cross, ``HASH_RUN_BYTES``), so no byte of a corrupt object is written; otherwise every
        object was checked before the first launch. Runs on the load stream itself."""
        self._check_usable()
        check = self.integrity.open_load(fmt.payload_bytes, hosts)
        if check.corrupt:
            return check.corrupt
        with self.streams.loading():
            corrupt = self._move_chunks(fmt, hosts, slots, Direction.LOAD, None, check=check)
        if not corrupt:
            corrupt = check.written_corrupt()
            self._scrub(fmt, slots, corrupt)
        return corrupt

    def _scrub(self, fmt: ChunkFormat, slots: Mapping[int, torch.Tensor], corrupt: Sequence[int]) -> None:
        """Zeros the rows the corrupt objects' loads wrote: the failed load's forward (a same-step load runs it
        before vLLM recomputes, its output discarded) then reads zeros, never a byte that failed its check. Costs a
        write of those rows, only when a load failed."""
        if not corrupt:
            return
        zeros = torch.zeros(max(launch.nbytes for launch in fmt.launches), dtype=torch.uint8)
        for index in corrupt:
            for launch in fmt.launches:
                self._transfer(launch, slots[launch.tg.group][index], zeros[: launch.nbytes], Direction.LOAD)

    def _load_launches(self, launches: Sequence[Launch], host: torch.Tensor, slots: Mapping[int, torch.Tensor],
                       index: int, check: ObjectCheck) -> bool:
        """``launches`` of object ``index`` of a batch, each written only where its stripes match; whether all
        were."""
        for launch in launches:
            region = host[launch.offset : launch.offset + launch.nbytes]
            backend = self._backends[id(launch.planes)]
            intact = backend.load_checked(launch.planes, slots[launch.tg.group][index], region, check, launch.offset)
            self.counters.launches += 1
            self.counters.backends.add(backend.name)
            if not intact:
                return False
        return True

    def _move_chunks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                     direction: Direction, launches: Sequence[Launch] | None, stripes: StoreStripes | None = None,
                     check: LoadCheck | None = None) -> list[int]:
        """Returns the corrupt objects' indices when a load hashed on the device finds them (before its
        scratch-full's launches); the kernels feed the stripe states of ``stripes`` or ``check`` (host objects)."""
        self._check_usable()
        moved = fmt.launches if launches is None else tuple(launches)
        states = stripes.states if stripes is not None else check.states if check is not None else None
        if not self.scratch:  # the objects are host memory: each chunk's kernels read or write its object itself
            for index, host in enumerate(hosts):
                for launch in moved:
                    region = host[launch.offset : launch.offset + launch.nbytes]
                    if states is None:
                        self._transfer(launch, slots[launch.tg.group][index], region, direction)
                    else:
                        self._hashed(launch, slots[launch.tg.group][index], region, states[index], direction)
            return []
        size = fmt.payload_bytes
        # Whole chunks cross in one copy each; one layer's pieces each in their own.
        spans = [(0, size)] if launches is None else [(piece.offset, piece.offset + piece.nbytes) for piece in moved]
        stream = self.streams.store_stream if direction is Direction.STORE else self.streams.load_stream
        hasher = self.integrity.device_hasher
        # Room for the CRCs the device makes of whole chunks, where it hashes them.
        room = (stripes.room if stripes is not None and launches is None else None) if check is None else check.room
        for first, count, scratch in self._batches(fmt, len(hosts), direction):
            pieces = [(scratch[i * size + start : i * size + end], hosts[first + i][start:end])
                      for i in range(count) for start, end in spans]
            if direction is Direction.LOAD:
                run = 0  # the first object not hashed yet
                for index, (piece, host) in enumerate(pieces):
                    piece.copy_(host, non_blocking=True)
                    if hasher is not None and room is not None and (
                            (index + 1 - run) * size >= HASH_RUN_BYTES or index + 1 == count):
                        with self.streams.beside(stream):  # hashed while the next objects cross
                            crcs = hasher.stripe_crcs(scratch[run * size :], index + 1 - run, size, size)
                            room[first + run : first + index + 1].copy_(crcs, non_blocking=True)
                        run = index + 1
                if check is not None and room is not None:  # this scratch-full checked before its own writes
                    carried = check.carried(hosts[first : first + count])
                    self.streams.wait_side(stream)
                    corrupt = check.differing(carried, first)
                    if corrupt:
                        return corrupt
            for launch in moved:
                rows = slots[launch.tg.group][first : first + count]
                self._transfer_chunks(launch, rows, scratch[launch.offset :], size, direction)
            if direction is Direction.STORE:
                if hasher is not None and room is not None:  # beside the copies to the host, which read it too
                    with self.streams.beside(stream):
                        crcs = hasher.stripe_crcs(scratch, count, size, size)
                        room[first : first + count].copy_(crcs, non_blocking=True)
                for piece, host in pieces:
                    host.copy_(piece, non_blocking=True)
                if room is not None:  # the next scratch-full's kernels overwrite what the hash reads
                    self.streams.rejoin(stream)
        return []

    def _batches(self, fmt: ChunkFormat, chunks: int, direction: Direction) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(first chunk, chunk count, scratch holding them side by side) for the chunks of one call. One scratch
        per direction serves every batch: the transfer stream runs a batch's copies before the next batch's
        launches overwrite it."""
        for first, count in batch_runs(chunks, fmt.payload_bytes):
            yield first, count, self.scratch[direction].get(count * fmt.payload_bytes)

    def _transfer(self, launch: Launch, rows: torch.Tensor, region: torch.Tensor, direction: Direction) -> None:
        backend = self._backends[id(launch.planes)]
        backend.transfer(launch.planes, rows, region, direction)
        self.counters.launches += 1
        self.counters.backends.add(backend.name)

    def _hashed(self, launch: Launch, rows: torch.Tensor, region: torch.Tensor, hashed: ObjectStripes,
                direction: Direction) -> None:
        backend = self._backends[id(launch.planes)]
        move = backend.store_hashed if direction is Direction.STORE else backend.load_hashed
        move(launch.planes, rows, region, hashed, launch.offset)
        self.counters.launches += 1
        self.counters.backends.add(backend.name)

    def _transfer_chunks(self, launch: Launch, rows: torch.Tensor, scratch: torch.Tensor, stride: int,
                         direction: Direction) -> None:
        backend = self._backends[id(launch.planes)]
        backend.transfer_chunks(launch.planes, rows, scratch, stride, direction)
        self.counters.launches += rows.shape[0]
        self.counters.backends.add(backend.name)


class BoundLayoutMixin:
    """What both connectors (paged, layerwise) share: the binding made at ``bind`` and its streams."""

    binding: LayoutBinding | None
    connector_kind = "connector"

    @property
    def store_stream(self) -> Any:
        """The device stream stores run on (None on CPU or before ``bind``)."""
        return self.binding.streams.store_stream if self.binding is not None else None

    @property
    def load_stream(self) -> Any:
        """The device stream loads run on (None on CPU or before ``bind``)."""
        return self.binding.streams.load_stream if self.binding is not None else None

    def _bound(self) -> LayoutBinding:
        if self.binding is None:
            raise TransferError(f"no KV layout is bound to the {self.connector_kind} yet: call bind(layout) when "
                                "the KV caches are registered, before the first store or retrieve")
        return self.binding

