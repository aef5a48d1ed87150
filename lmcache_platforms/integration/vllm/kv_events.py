"""KV events for KV-aware routers: what a request stored in LMCache becomes vLLM's ``BlockStored`` events, and a
prefix-cache reset an ``AllBlocksCleared``, published by vLLM's own publisher (``--kv-events-config``).

The workers know what they wrote, the scheduler knows vLLM's block hashes, so the work is split: after a
request's store a worker reports the prefix it made a hit (``StoredPrefix``: tokens ``[start, end)``, every
group's part written, a recurrent state at ``end``); vLLM gathers the workers' reports into one ``StoredPrefixes``
per step; the scheduler side keeps those every worker reported (each stores its own shard of every chunk) and
turns them into one ``BlockStored`` per tier with the request's own block hashes, token ids, LoRA adapter and
extra keys, exactly as vLLM's prefix cache would publish those blocks. An event covers every KV-cache group
(``group_idx`` is None): a prefix it names is a hit for every group at once.

What a local tier drops (evicted, or removed as corrupt) becomes ``BlockRemoved``: a worker names each stored
chunk as every worker and tier name it (``chunk_id``) in its report, and reports the chunks its local tiers
drop (``RemovedChunk``, heard through ``connector.tier_watch``); the scheduler side remembers each stored chunk's
block hashes (the request may be long gone when its chunks are evicted) and publishes the blocks of a dropped
chunk once per tier, when the first worker reports it (every worker must hold a chunk for it to be a hit). The
remote tier, shared and never evicting on our behalf, publishes no removal.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from lmcache_platforms.connector.parts import PART_TAG
from lmcache_platforms.integration.vllm.vllm_compat import MEDIUM_CPU, MEDIUM_STORAGE, event_extra_keys, event_fields
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)

ChunkId = tuple[int, tuple[tuple[str, Any], ...]]
"""A stored chunk as every worker and every tier name it: LMCache's chunk hash and its key's tags, but the part's
(a chunk stored in parts loses its hit with any one of them)."""
MAX_TRACKED_CHUNKS = 1 << 16
"""Stored chunks whose block hashes the scheduler side keeps for their removal (the oldest are forgotten first:
a removal of one of those is not published)."""
_PART_TAG_NAME = PART_TAG.removeprefix("lmcache.tag.")


def chunk_id(key: Any) -> ChunkId:
    """The ``ChunkId`` of an LMCache key (``CacheEngineKey``)."""
    return key.chunk_hash, tuple(tag for tag in key.tags or () if tag[0] != _PART_TAG_NAME)


@dataclass(frozen=True)
class StoredPrefix:
    """One worker's report: request ``req_id``'s tokens ``[start, end)`` were written to LMCache by one store,
    and tokens ``[0, end)`` are a hit; ``chunks`` names each chunk written, with its tokens."""

    req_id: str
    start: int
    end: int
    chunks: tuple[tuple[int, int, ChunkId], ...] = ()


@dataclass(frozen=True)
class RemovedChunk:
    """One worker's report: a local tier (vLLM's ``medium`` and ``locality`` words) dropped a stored chunk."""

    chunk: ChunkId
    medium: str
    locality: str


class StoredPrefixes(KVConnectorKVEvents):
    """The reports of the workers vLLM gathered into one step's output (it adds each worker's and counts them)."""

    def __init__(self, reports: Iterable[StoredPrefix | RemovedChunk] = (), workers: int = 1) -> None:
        self._reports: Counter[StoredPrefix | RemovedChunk] = Counter(reports)
        self._workers = workers

    def add_events(self, events: list[Any]) -> None:
        self._reports.update(events)

    def aggregate(self) -> StoredPrefixes:
        """Keep what every worker stored and what any worker's tiers dropped."""
        self._reports = Counter({report: 1 for report in self.common()})
        self._workers = 1
        return self

    def common(self) -> list[StoredPrefix | RemovedChunk]:
        """The stores every worker reported and the removals any worker reported, in the order they arrived."""
        return [report for report, count in self._reports.items()
                if isinstance(report, RemovedChunk) or count >= self._workers]

    def increment_workers(self, count: int = 1) -> None:
        self._workers += count

    def get_all_events(self) -> list[Any]:
        return list(self._reports.elements())

    def get_number_of_workers(self) -> int:
        return self._workers

    def clear_events(self) -> None:
        self._reports.clear()
        self._workers = 1


@dataclass(frozen=True)
class Tier:
    """Where an event says the blocks live: vLLM's medium and locality words."""

    medium: str
    locality: str


_CPU = Tier(MEDIUM_CPU, "LOCAL")
_DISK = Tier(MEDIUM_STORAGE, "LOCAL")
_REMOTE = Tier(MEDIUM_STORAGE, "REMOTE")
_LOCAL_BACKENDS = {"LocalCPUBackend": _CPU, "LocalDiskBackend": _DISK}
"""The backends that report what they drop (``connector.tier_watch``), by their storage manager name."""


def tiers_of(config: Any) -> tuple[Tier, ...]:
    """The tiers LMCache writes every stored chunk to, from its config: local CPU memory, local disk, a remote
    store (shared with every server of the same store: ``REMOTE``)."""
    tiers = []
    if getattr(config, "local_cpu", False):
        tiers.append(_CPU)
    if getattr(config, "local_disk", None):
        tiers.append(_DISK)
    if getattr(config, "remote_url", None):
        tiers.append(_REMOTE)
    return tuple(tiers)


def local_tiers(backends: Mapping[str, Any]) -> list[tuple[Any, Tier]]:
    """The backends of an LMCache storage manager (``storage_backends``) that report what they drop, with their
    tier."""
    return [(backend, _LOCAL_BACKENDS[name]) for name, backend in backends.items() if name in _LOCAL_BACKENDS]


def external_hashes(hashes: list[Any]) -> list[Any]:
    """What vLLM publishes for its block hashes (``maybe_convert_block_hash``, its setting read once, not per
    hash: a 2,048-token store has 128 of them): the low 64 bits as an int, or the bytes themselves."""
    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return list(hashes)
    return [int.from_bytes(block_hash, byteorder="big") & 0xFFFF_FFFF_FFFF_FFFF for block_hash in hashes]


class _Published:
    """A request's block hashes as ``external_hashes`` gives them, each converted once for all of a report's uses."""

    def __init__(self, block_hashes: list[Any]) -> None:
        self._source = block_hashes
        self._converted: list[Any] = []
        self._first: int | None = None
        """The block ``_converted`` starts at."""

    def __call__(self, first: int, last: int) -> list[Any]:
        if self._first is None:
            self._first = first
        if first < self._first:
            self._converted[:0] = external_hashes(self._source[first:self._first])
            self._first = first
        end = self._first + len(self._converted)
        if last > end:
            self._converted.extend(external_hashes(self._source[end:last]))
        return self._converted[first - self._first:last - self._first]


def _extra_keys(request: Request, first: int, last: int, hash_block_size: int) -> list[tuple[Any, ...] | None]:
    """Each block's extra hash keys as vLLM computes them (none without an adapter, salt or multimodal input)."""
    if not (request.lora_request or request.cache_salt or request.mm_features or request.prompt_embeds is not None):
        return [None] * (last - first)
    keys, mm_index = [], 0
    for index in range(first, last):
        block_keys, mm_index = generate_block_hash_extra_keys(request, index * hash_block_size,
                                                              (index + 1) * hash_block_size, mm_index)
        keys.append(block_keys)
    return keys


def block_stored(request: Request, first: int, last: int, hash_block_size: int, tiers: tuple[Tier, ...],
                 published: Callable[[int, int], list[Any]]) -> list[BlockStored]:
    """vLLM's event for the request's hash blocks ``[first, last)``, as its prefix cache builds one, for each tier;
    ``published(a, b)``: blocks ``[a, b)`` as ``external_hashes`` gives them."""
    hashes = published(max(0, first - 1), last)
    lora = request.lora_request
    fields = event_fields(BlockStored, {
        "block_hashes": hashes[1:] if first else hashes,
        "parent_block_hash": hashes[0] if first else None,
        "token_ids": list(request.all_token_ids[first * hash_block_size:last * hash_block_size]),
        "block_size": hash_block_size,
        "lora_id": lora.adapter_id if lora else None,
        "medium": None,
        "lora_name": lora.name if lora else None,
        "extra_keys": event_extra_keys(_extra_keys(request, first, last, hash_block_size)),
        "locality": None,
        "session_id": getattr(request, "session_id", None),
    })
    return [BlockStored(**{**fields, **event_fields(BlockStored, {"medium": tier.medium, "locality": tier.locality})})
            for tier in tiers]


class EventQueue:
    """The scheduler side's events until vLLM takes them (``take_events``, once per step)."""

    def __init__(self, enabled: bool, hash_block_size: int, tiers: tuple[Tier, ...]) -> None:
        self.enabled = enabled and bool(tiers)
        self._hash_block_size = hash_block_size
        self._tiers = tiers
        self._events: list[KVCacheEvent] = []
        self._published: dict[str, int] = {}
        self._dropping = frozenset(tiers) & {_CPU, _DISK}
        self._chunks: OrderedDict[ChunkId, tuple[list[Any], set[Tier]]] = OrderedDict()
        """Each stored chunk's block hashes, and the tiers that hold it and report when they drop it."""

    def stored(self, reports: Any, requests: dict[str, Request]) -> None:
        """One step's gathered worker reports: an event per tier for the hash blocks each prefix adds, and for
        the blocks of each chunk a tier dropped."""
        if not self.enabled or not isinstance(reports, StoredPrefixes):
            return
        for report in reports.common():
            if isinstance(report, RemovedChunk):
                self._removed(report)
                continue
            request = requests.get(report.req_id)
            if request is None:
                logger.debug("request %s ended before its store was reported: no KV event", report.req_id)
                continue
            published = _Published(request.block_hashes)
            self._track(request, report.chunks, published)
            first = max(report.start // self._hash_block_size, self._published.get(report.req_id, 0))
            last = min(report.end // self._hash_block_size, len(request.block_hashes))
            if last <= first:
                continue
            self._published[report.req_id] = last
            self._events.extend(block_stored(request, first, last, self._hash_block_size, self._tiers, published))

    def _track(self, request: Request, chunks: tuple[tuple[int, int, ChunkId], ...], published: _Published) -> None:
        """Remember the hash blocks each stored chunk overlaps (losing the chunk loses them)."""
        if not self._dropping or not chunks:
            return
        size = self._hash_block_size
        published(chunks[0][0] // size, min(-(-chunks[-1][1] // size), len(request.block_hashes)))  # at once
        for start, end, chunk in chunks:
            first, last = start // size, min(-(-end // size), len(request.block_hashes))
            if last <= first:
                continue
            self._chunks[chunk] = (published(first, last), set(self._dropping))
            self._chunks.move_to_end(chunk)
            if len(self._chunks) > MAX_TRACKED_CHUNKS:
                self._chunks.popitem(last=False)

    def _removed(self, report: RemovedChunk) -> None:
        """A tier dropped a chunk: its blocks are no hit there any more (published once per tier)."""
        tier = Tier(report.medium, report.locality)
        entry = self._chunks.get(report.chunk)
        if entry is None or tier not in entry[1]:
            return
        hashes, holding = entry
        holding.discard(tier)
        if not holding:
            del self._chunks[report.chunk]
        self._events.append(BlockRemoved(**event_fields(BlockRemoved, {
            "block_hashes": list(hashes), "medium": tier.medium, "locality": tier.locality})))

    def finished(self, req_id: str) -> None:
        self._published.pop(req_id, None)

    def cleared(self) -> None:
        """A prefix-cache reset: nothing stored before is a hit any more."""
        if self.enabled:
            self._events.append(AllBlocksCleared())
            self._published.clear()
            self._chunks.clear()

    def take(self) -> Iterator[KVCacheEvent]:
        events, self._events = self._events, []
        yield from events
