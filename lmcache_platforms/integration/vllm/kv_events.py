"""KV events for KV-aware routers: what a request stored in LMCache becomes vLLM's ``BlockStored`` events, and a
prefix-cache reset an ``AllBlocksCleared``, published by vLLM's own publisher (``--kv-events-config``).

The workers know what they wrote, the scheduler knows vLLM's block hashes, so the work is split: after a
request's store a worker reports the prefix it made a hit (``StoredPrefix``: tokens ``[start, end)``, every
group's part written, a recurrent state at ``end``); vLLM gathers the workers' reports into one ``StoredPrefixes``
per step; the scheduler side keeps those every worker reported (each stores its own shard of every chunk) and
turns them into one ``BlockStored`` per tier with the request's own block hashes, token ids, LoRA adapter and
extra keys, exactly as vLLM's prefix cache would publish those blocks. An event covers every KV-cache group
(``group_idx`` is None): a prefix it names is a hit for every group at once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm import envs
from vllm.distributed.kv_events import AllBlocksCleared, BlockStored, KVCacheEvent, KVConnectorKVEvents
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

from lmcache_platforms.integration.vllm.vllm_compat import MEDIUM_CPU, MEDIUM_STORAGE, event_extra_keys, event_fields
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(__name__)


@dataclass(frozen=True)
class StoredPrefix:
    """One worker's report: request ``req_id``'s tokens ``[start, end)`` were written to LMCache by one store,
    and tokens ``[0, end)`` are a hit."""

    req_id: str
    start: int
    end: int


class StoredPrefixes(KVConnectorKVEvents):
    """The reports of the workers vLLM gathered into one step's output (it adds each worker's and counts them)."""

    def __init__(self, reports: Iterable[StoredPrefix] = (), workers: int = 1) -> None:
        self._reports: Counter[StoredPrefix] = Counter(reports)
        self._workers = workers

    def add_events(self, events: list[Any]) -> None:
        self._reports.update(events)

    def aggregate(self) -> StoredPrefixes:
        """Keep what every worker reported."""
        self._reports = Counter({report: 1 for report in self.common()})
        self._workers = 1
        return self

    def common(self) -> list[StoredPrefix]:
        """The reports every worker made, in the order they arrived."""
        return [report for report, count in self._reports.items() if count >= self._workers]

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


def tiers_of(config: Any) -> tuple[Tier, ...]:
    """The tiers LMCache writes every stored chunk to, from its config: local CPU memory, local disk, a remote
    store (shared with every server of the same store: ``REMOTE``)."""
    tiers = []
    if getattr(config, "local_cpu", False):
        tiers.append(Tier(MEDIUM_CPU, "LOCAL"))
    if getattr(config, "local_disk", None):
        tiers.append(Tier(MEDIUM_STORAGE, "LOCAL"))
    if getattr(config, "remote_url", None):
        tiers.append(Tier(MEDIUM_STORAGE, "REMOTE"))
    return tuple(tiers)


def external_hashes(hashes: list[Any]) -> list[Any]:
    """What vLLM publishes for its block hashes (``maybe_convert_block_hash``, its setting read once, not per
    hash: a 2,048-token store has 128 of them): the low 64 bits as an int, or the bytes themselves."""
    if not envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES:
        return list(hashes)
    return [int.from_bytes(block_hash, byteorder="big") & 0xFFFF_FFFF_FFFF_FFFF for block_hash in hashes]


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


def block_stored(request: Request, first: int, last: int, hash_block_size: int, tier: Tier) -> BlockStored:
    """vLLM's event for the request's hash blocks ``[first, last)``, as its prefix cache builds one."""
    hashes = external_hashes(request.block_hashes[max(0, first - 1):last])
    lora = request.lora_request
    return BlockStored(**event_fields(BlockStored, {
        "block_hashes": hashes[1:] if first else hashes,
        "parent_block_hash": hashes[0] if first else None,
        "token_ids": list(request.all_token_ids[first * hash_block_size:last * hash_block_size]),
        "block_size": hash_block_size,
        "lora_id": lora.adapter_id if lora else None,
        "medium": tier.medium,
        "lora_name": lora.name if lora else None,
        "extra_keys": event_extra_keys(_extra_keys(request, first, last, hash_block_size)),
        "locality": tier.locality,
        "session_id": getattr(request, "session_id", None),
    }))


class EventQueue:
    """The scheduler side's events until vLLM takes them (``take_events``, once per step)."""

    def __init__(self, enabled: bool, hash_block_size: int, tiers: tuple[Tier, ...]) -> None:
        self.enabled = enabled and bool(tiers)
        self._hash_block_size = hash_block_size
        self._tiers = tiers
        self._events: list[KVCacheEvent] = []
        self._published: dict[str, int] = {}

    def stored(self, reports: Any, requests: dict[str, Request]) -> None:
        """One step's gathered worker reports: an event per tier for the hash blocks each prefix adds."""
        if not self.enabled or not isinstance(reports, StoredPrefixes):
            return
        for report in reports.common():
            request = requests.get(report.req_id)
            if request is None:
                logger.debug("request %s ended before its store was reported: no KV event", report.req_id)
                continue
            first = max(report.start // self._hash_block_size, self._published.get(report.req_id, 0))
            last = min(report.end // self._hash_block_size, len(request.block_hashes))
            if last <= first:
                continue
            self._published[report.req_id] = last
            self._events.extend(block_stored(request, first, last, self._hash_block_size, tier)
                                for tier in self._tiers)

    def finished(self, req_id: str) -> None:
        self._published.pop(req_id, None)

    def cleared(self) -> None:
        """A prefix-cache reset: nothing stored before is a hit any more."""
        if self.enabled:
            self._events.append(AllBlocksCleared())
            self._published.clear()

    def take(self) -> Iterator[KVCacheEvent]:
        events, self._events = self._events, []
        yield from events
