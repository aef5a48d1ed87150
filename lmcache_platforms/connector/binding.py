"""What a connector knows once the KV caches exist: the layout, its chunk formats, kernels and streams.

Both connectors (paged and layerwise) exist from engine creation but only learn the layout when vLLM
registers its KV caches, so everything layout-dependent lives here and is built by ``bind``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_platforms.connector import checksum
from lmcache_platforms.connector.chunk_format import LAYOUT_TAG, ChunkFormat, Launch, layer_launches, layout_fingerprint
from lmcache_platforms.connector.streams import Scratch, TransferStreams, platform_for
from lmcache_platforms.kernels.contract import Direction, KernelBackend, TransferError
from lmcache_platforms.kernels.crc32c import ObjectCheck, ObjectStripes
from lmcache_platforms.kernels.registry import device_hasher, select_backend
from lmcache_platforms.kernels.stripe_hashing import DeviceStripeHasher
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
        self.device_hasher: DeviceStripeHasher | None = (
            device_hasher(platform.name, self.device) if staged and checksum.stripes_are_crc32c() else None)
        """What makes whole staged chunks' stripe CRCs on the device (the kernel registry's choice), or None: a
        pass over host memory does."""
        self.hashes_on_device = self.device_hasher is not None
        """Whether the device hashes now: a switch over ``device_hasher`` (``bench`` turns it off to time the host's
        pass beside the device's)."""
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

    @staticmethod
    def seal(fmt: ChunkFormat, hosts: Sequence[torch.Tensor], stripes: torch.Tensor | None = None) -> None:
        """Write each stored object's checksum trailer; call once their bytes are in host memory. ``stripes``:
        their stripe CRCs as ``store_chunks`` returned them (computed on the device), if it did."""
        checksum.seal(hosts, fmt.payload_bytes, stripes)

    @staticmethod
    def corrupt(fmt: ChunkFormat, hosts: Sequence[torch.Tensor]) -> list[int]:
        """Indices of the objects whose payload does not match their trailer; check before loading any."""
        return checksum.mismatched(hosts, fmt.payload_bytes)

    def store_chunks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                     launches: Sequence[Launch] | None = None,
                     hashing: Sequence[ObjectStripes] | None = None) -> torch.Tensor | None:
        """Planes -> every object of ``hosts`` (the MemoryObjs' bytes; ``slots`` from ``chunk_slots``); call
        inside ``streams.storing()``. ``launches``: some of ``fmt``'s bytes only (one layer's, ``layer_launches``).
        Staged through device scratch, each launch moves a scratch-full of chunks at once (see
        ``BATCH_SCRATCH_BYTES``), then each chunk's bytes cross to its object. Whole chunks staged on a GPU are
        hashed there too, on a side stream while they cross: returns their stripe CRCs for ``seal`` (pinned host
        memory, final once the store stream is finished); whole chunks stored straight into host objects get
        them from the store kernels, which hash each byte as they copy it (``KernelBackend.store_hashed``); else
        None. ``hashing`` (``layer_stripes``):
        the objects' stripe states one layer's pieces add to, hashed as they are copied too."""
        stripes = None
        if launches is None and self.scratch:
            stripes = self._stripes_on_device(fmt, len(hosts))
        elif launches is None:
            stripes = checksum.stripe_room(fmt.payload_bytes, len(hosts))
        self._move_chunks(fmt, hosts, slots, Direction.STORE, launches, stripes, hashing)
        return stripes

    def layer_stripes(self, fmt: ChunkFormat, objects: int) -> list[ObjectStripes] | None:
        """For a layer-by-layer store into host objects: each object's stripe state, which every layer's
        ``store_chunks(..., hashing=)`` adds to as its kernels copy (pieces join in any order); then
        ``finish_stripes`` gives ``seal`` their CRCs. None when the chunks are staged on a device or the native
        CRC-32C is missing, or the objects have no payload: ``seal`` then hashes the objects in a pass."""
        if not self._hashes_in_copy(fmt):
            return None
        return checksum.object_stripes(fmt.payload_bytes, objects)

    @staticmethod
    def finish_stripes(fmt: ChunkFormat, hashing: Sequence[ObjectStripes]) -> torch.Tensor:
        """The stripe CRCs of objects every layer of which was stored with ``hashing``, for ``seal``."""
        stripes = checksum.stripe_room(fmt.payload_bytes, len(hashing))
        assert stripes is not None, "layer_stripes made them, so the native CRC-32C is there"
        for index, hashed in enumerate(hashing):
            hashed.finish(stripes[index])
        return stripes

    def load_chunks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                    launches: Sequence[Launch]) -> None:
        """One layer's pieces (``layer_launches``) of every object of ``hosts`` -> planes, the objects checked
        already (``corrupt``); call inside ``streams.loading()``. Staged through device scratch: each chunk's
        piece crosses first, then each launch moves a scratch-full."""
        self._move_chunks(fmt, hosts, slots, Direction.LOAD, launches, None)

    def load_verified(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor],
                      slots: Mapping[int, torch.Tensor]) -> list[int]:
        """Loads the objects of ``hosts`` whole and checks them; returns the indices of those whose bytes do not
        match their checksum, before anything may read the rows: the caller then fails the load (LMCache's
        retrieve reports no token), and vLLM recomputes over the rows, so no request is answered from them.
        Host objects (the native library built) are hashed as they are copied (``_load_hashed``): one read of
        each object; a corrupt one's rows are written before the verdict, then zeroed. An object whose stripe
        table fails its trailer writes nothing. Staged on a GPU each run of objects is hashed there once it has
        crossed, on a side stream while the next ones cross (``HASH_RUN_BYTES``), and each scratch-full's CRCs
        are read back and compared with those its objects carry before its own launches (the device hashes far
        faster than the bus moves, and a host pass in a vLLM worker runs on one thread): no byte of a corrupt
        object is written. Otherwise (objects with no payload too: a layerwise step of layers that hold no row
        of the chunk) every object is checked before the first launch. Runs on the load stream itself."""
        stripes = self._stripes_on_device(fmt, len(hosts))
        if stripes is None and self._hashes_in_copy(fmt):
            return self._load_hashed(fmt, hosts, slots)
        corrupt = [] if stripes is not None else self.corrupt(fmt, hosts)
        if not corrupt:
            with self.streams.loading():
                corrupt = self._move_chunks(fmt, hosts, slots, Direction.LOAD, None, stripes)
        return corrupt

    def object_checks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor]) -> list[ObjectCheck] | None:
        """For a layer-by-layer load (``load_layer_checked``): each host object's stripe-by-stripe check, kept
        across the layers. None when this binding cannot check as it loads (chunks staged on a device, or no
        native CRC-32C) or an object's stripe table fails its trailer: then check them whole first (``corrupt``)."""
        if not self._hashes_host_objects():
            return None
        checks = checksum.object_checks(hosts, fmt.payload_bytes)
        return None if None in checks else [check for check in checks if check is not None]

    def load_layer_checked(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                           launches: Sequence[Launch], checks: Sequence[ObjectCheck]) -> list[int]:
        """One layer's pieces (``layer_launches``) of every host object -> planes, each writing only rows whose
        stripes match the CRCs its object carries (``checks`` from ``object_checks``), so no pass over the
        objects comes first. [], or at the first mismatch the indices of the corrupt objects: that one, and every
        other whose stripes do not all match (the load stops; earlier layers stay written, with verified bytes).
        After the last layer, ``unmatched`` says whether each object matched in the stripes no row needed too."""
        self._check_usable()
        for index, host in enumerate(hosts):
            if not self._load_launches(launches, host, slots, index, checks[index]):
                return [index] + [other for other in self.unmatched(fmt, checks) if other != index]
        return []

    @staticmethod
    def unmatched(fmt: ChunkFormat, checks: Sequence[ObjectCheck]) -> list[int]:
        """Indices of the objects whose stripes do not all match (hashing those not checked yet)."""
        return [index for index, check in enumerate(checks) if not check.check(0, fmt.payload_bytes)]

    def _hashes_host_objects(self) -> bool:
        """Whether the kernels hash objects as they store them and check them stripe by stripe as they load them:
        host objects (not staged on a device) and the native CRC-32C built."""
        return not self.scratch and checksum.stripes_are_crc32c()

    def _hashes_in_copy(self, fmt: ChunkFormat) -> bool:
        """Whether whole objects of ``fmt`` are hashed by the kernels that copy them: host objects, the native
        CRC-32C, and a payload to copy (objects without one are hashed in a pass, which has their one stripe)."""
        return self._hashes_host_objects() and fmt.payload_bytes > 0

    def _load_hashed(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor],
                     slots: Mapping[int, torch.Tensor]) -> list[int]:
        """Host objects loaded whole, each launch hashing the bytes it copies (``KernelBackend.load_hashed``),
        then every object's stripes compared with the CRCs it carries: the indices of those that differ, whose
        rows are then zeroed (``_scrub``). When an object's table fails its trailer nothing is written, and every
        corrupt object is named (a pass over them all, only then)."""
        self._check_usable()
        size = fmt.payload_bytes
        tables = checksum.carried_tables(hosts, size)
        if tables is None:
            return checksum.mismatched(hosts, size)
        hashing = checksum.object_stripes(size, len(hosts))
        for index, host in enumerate(hosts):
            for launch in fmt.launches:
                region = host[launch.offset : launch.offset + launch.nbytes]
                self._hashed(launch, slots[launch.tg.group][index], region, hashing[index], Direction.LOAD)
        corrupt = checksum.unverified(hashing, tables)
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

    def _stripes_on_device(self, fmt: ChunkFormat, objects: int) -> torch.Tensor | None:
        """Pinned room for the stripe CRCs of ``objects`` staged objects, when the device hashes them."""
        if not self.hashes_on_device or self.device_hasher is None or not self.device_hasher.aligned(fmt.payload_bytes):
            return None
        stripes = -(-fmt.payload_bytes // checksum.STRIPE_BYTES)
        return torch.empty((objects, stripes), dtype=torch.int32, pin_memory=self.device.type != "cpu")

    def _move_chunks(self, fmt: ChunkFormat, hosts: Sequence[torch.Tensor], slots: Mapping[int, torch.Tensor],
                     direction: Direction, launches: Sequence[Launch] | None, stripes: torch.Tensor | None,
                     hashing: Sequence[ObjectStripes] | None = None) -> list[int]:
        """Returns the corrupt objects' indices when a load checks ``stripes`` (before its scratch-full's
        launches); stores fill them, or add to ``hashing`` (host objects)."""
        self._check_usable()
        moved = fmt.launches if launches is None else tuple(launches)
        if not self.scratch:  # the objects are host memory: each chunk's kernels read or write its object itself
            if hashing is None and stripes is not None:
                hashing = checksum.object_stripes(fmt.payload_bytes, len(hosts))
            for index, host in enumerate(hosts):
                hashed = hashing[index] if hashing is not None else None
                for launch in moved:
                    region = host[launch.offset : launch.offset + launch.nbytes]
                    if hashed is None:
                        self._transfer(launch, slots[launch.tg.group][index], region, direction)
                    else:
                        self._hashed(launch, slots[launch.tg.group][index], region, hashed, Direction.STORE)
                if hashed is not None and stripes is not None:
                    hashed.finish(stripes[index])
            return []
        size = fmt.payload_bytes
        # Whole chunks cross in one copy each; one layer's pieces each in their own.
        spans = [(0, size)] if launches is None else [(piece.offset, piece.offset + piece.nbytes) for piece in moved]
        stream = self.streams.store_stream if direction is Direction.STORE else self.streams.load_stream
        hasher = self.device_hasher  # with ``stripes`` (room for its CRCs), the device hashes these objects
        for first, count, scratch in self._batches(fmt, len(hosts), direction):
            pieces = [(scratch[i * size + start : i * size + end], hosts[first + i][start:end])
                      for i in range(count) for start, end in spans]
            if direction is Direction.LOAD:
                run = 0  # the first object not hashed yet
                for index, (piece, host) in enumerate(pieces):
                    piece.copy_(host, non_blocking=True)
                    if hasher is not None and stripes is not None and (
                            (index + 1 - run) * size >= HASH_RUN_BYTES or index + 1 == count):
                        with self.streams.beside(stream):  # hashed while the next objects cross
                            crcs = hasher.stripe_crcs(scratch[run * size :], index + 1 - run, size, size)
                            stripes[first + run : first + index + 1].copy_(crcs, non_blocking=True)
                        run = index + 1
                if stripes is not None:  # load_verified: this scratch-full checked before its own writes
                    carried = checksum.carried_stripes(hosts[first : first + count], size)
                    self.streams.wait_side(stream)
                    corrupt = checksum.differing(carried, stripes[first : first + count])
                    if corrupt:
                        return [first + index for index in corrupt]
            for launch in moved:
                rows = slots[launch.tg.group][first : first + count]
                self._transfer_chunks(launch, rows, scratch[launch.offset :], size, direction)
            if direction is Direction.STORE:
                if hasher is not None and stripes is not None:  # beside the copies to the host, which read it too
                    with self.streams.beside(stream):
                        crcs = hasher.stripe_crcs(scratch, count, size, size)
                        stripes[first : first + count].copy_(crcs, non_blocking=True)
                for piece, host in pieces:
                    host.copy_(piece, non_blocking=True)
                if stripes is not None:  # the next scratch-full's kernels overwrite what the hash reads
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

