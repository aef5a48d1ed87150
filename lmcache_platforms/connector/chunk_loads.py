"""One load of a hit from LMCache's storage into the KV caches: a ``LoadJob`` goes down, a ``LoadResult`` comes back.

The job names everything the load needs (the hit's tokens, which of them to load, every group's block ids, the
request's key configs, a layer gate, a write guard); nothing travels through LMCache's ``retrieve`` signature,
state set around a call, or counters read before and after. The load:

1. keys the chunks each part needs (``layout.parts.needed_chunks``: every chunk for full attention, a window
   part's only where its window reaches the hit's end; whole chunks when the layout has no parts);
2. finds the tier of every object at once: the pins of the lookup made for this request when they hold them
   all, else one question for all (``parts.where_held``); a hit missing one object loads nothing;
3. reads every object from its tier (``StorageManager.batched_get``, one call per tier), then writes each part's
   objects (``LayoutGPUConnector.load_objects``) inside the job's guard, hashing as it copies;
4. releases its references to every object however it ends; an object that failed its checksum is removed from
   every tier (the next lookup misses instead of failing again) and the load reports no token, so vLLM
   recomputes over the rows.

LMCache's own ``retrieve`` still serves the modes where its engine brings the objects itself (an MLA rank that
receives them by broadcast; a PD receiver), with the job as its keyword arguments (``connector.request``); a
corrupt object then fails the load through the guard. LMCache's asynchronous loading is refused at start-up
(``engine_impl.refuse_unsupported_lmcache_modes``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from lmcache_platforms.connector.binding import add_group_bytes
from lmcache_platforms.connector.paged import LayoutGPUConnector
from lmcache_platforms.connector.parts import objects_per_part, part_configs, where_held
from lmcache_platforms.connector.request import BLOCK_IDS, LAYER_GATE, LOAD_GUARD, ChunkJob, WriteGuard
from lmcache_platforms.layout.parts import ChunkPart, needed_chunks
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class LoadJob(ChunkJob):
    """One request's load (``ChunkJob``; the mask may leave out a prefix vLLM holds, whose block ids are 0),
    inside ``guard``. ``vllm_cached_tokens`` is vLLM's own hit, which LMCache's GPU connectors read instead
    (through LMCache's retrieve) to leave those rows alone."""

    guard: WriteGuard | None = None
    vllm_cached_tokens: int = 0


@dataclass
class LoadResult:
    """What a load did: the tokens it wrote (none when any needed object was missing or corrupt), the keys of
    the corrupt objects it removed, and the bytes and chunks it moved (bytes by KV-cache group too)."""

    arrived: torch.Tensor
    corrupt: list[str] = field(default_factory=list)
    chunks: int = 0
    bytes: int = 0
    group_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return int(self.arrived.sum())


@dataclass(frozen=True)
class _Chunk:
    part: ChunkPart | None
    start: int
    end: int
    key: Any

    @property
    def part_index(self) -> int | None:
        return None if self.part is None else self.part.index


def load(engine: Any, job: LoadJob) -> LoadResult:
    """Load ``job`` through ``engine`` (an LMCache engine whose GPU connector is ours, or any other, which
    LMCache's own retrieve serves)."""
    connector = engine.gpu_connector
    if not isinstance(connector, LayoutGPUConnector) or engine_brings_objects(engine):
        return _through_lmcache(engine, job)
    nothing = LoadResult(torch.zeros(len(job.tokens), dtype=torch.bool))
    if not engine.is_healthy():
        logger.warning("request %s: LMCache is unhealthy: nothing loaded", job.req_id)
        return nothing
    wanted = job.wanted()
    stats = engine.stats_monitor.on_retrieve_request(int(wanted.sum()))
    started = time.perf_counter()
    chunks = _chunks(engine, connector.parts, job, wanted)
    objects: list[Any] = []
    result = nothing
    try:
        objects = _read(engine, job, chunks)
        if objects:
            arrived = torch.zeros_like(wanted)
            for chunk in chunks:
                arrived[chunk.start:chunk.end] = wanted[chunk.start:chunk.end]
            result = _write(engine, connector, job, chunks, objects, arrived)
    finally:
        for memory_obj in objects:
            if memory_obj is not None:
                memory_obj.ref_count_down()
        engine.stats_monitor.on_retrieve_finished(stats, result.tokens)
    logger.info("request %s: read %d objects (%s) for %d of %d tokens, %d bytes written, %.3f ms", job.req_id,
                len(chunks), objects_per_part([chunk.part for chunk in chunks]), result.tokens, int(wanted.sum()),
                result.bytes, (time.perf_counter() - started) * 1000)
    return result


def engine_brings_objects(engine: Any) -> bool:
    """LMCache's engine fetches the objects itself: an MLA rank's broadcast, a PD receiver's buffer."""
    return bool(engine.save_only_first_rank or engine.remove_after_retrieve)


def _chunks(engine: Any, parts: Sequence[ChunkPart], job: LoadJob, wanted: torch.Tensor) -> list[_Chunk]:
    """Every object the load needs, part by part, in token order within each part."""
    if not parts:
        return [_Chunk(None, start, end, key) for start, end, key in engine.token_database.process_tokens(
            tokens=job.tokens, mask=wanted, request_configs=dict(job.request_configs))]
    chunk_size = engine.config.chunk_size
    chunks = []
    for part in parts:
        needed = needed_chunks(part.reach, len(job.tokens), chunk_size)
        part_mask = wanted.clone()
        part_mask[: needed[0] * chunk_size if needed else len(job.tokens)] = False
        if not bool(part_mask.any()):
            continue
        chunks += [_Chunk(part, start, end, key) for start, end, key in engine.token_database.process_tokens(
            tokens=job.tokens, mask=part_mask, request_configs=part_configs(job.request_configs, part))]
    return chunks


def _read(engine: Any, job: LoadJob, chunks: list[_Chunk]) -> list[Any]:
    """Every chunk's object, read from the tier holding it (one call per tier), ``chunks`` cut to those returned.
    Chunks stored whole: the run from the first that is held and read (a shorter hit); in parts, every part's
    chunks or nothing. Objects read but not kept are released here."""
    keys = [chunk.key for chunk in chunks]
    held, tiers = where_held(engine, keys, job.req_id)
    if held < len(keys):
        chunk = chunks[held]
        if chunk.part is not None:
            logger.warning("request %s: part %s of chunk %d of a %d-token hit is gone: nothing loaded", job.req_id,
                           chunk.part.name, chunk.start // engine.config.chunk_size, len(job.tokens))
            chunks.clear()
            return []
        logger.warning("request %s: the object of tokens [%d, %d) is gone: the load ends there", job.req_id,
                       chunk.start, chunk.end)
        del chunks[held:]
        keys = keys[:held]
    objects: list[Any] = [None] * len(chunks)
    by_tier: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        by_tier.setdefault(tiers[key], []).append(index)
    for tier, indices in by_tier.items():
        for index, memory_obj in zip(indices, engine.storage_manager.batched_get(
                keys=[keys[i] for i in indices], location=tier), strict=True):
            objects[index] = memory_obj
    unread = next((i for i, memory_obj in enumerate(objects) if memory_obj is None), None)
    if unread is None:
        return objects
    chunk = chunks[unread]
    # Whole chunks: the run before the unread one loads (a shorter hit); in parts, nothing does.
    keep = unread if chunk.part is None else 0
    logger.warning("request %s: the object of tokens [%d, %d)%s could not be read: %s", job.req_id, chunk.start,
                   chunk.end, "" if chunk.part is None else f" (part {chunk.part.name})",
                   "the load ends there" if keep else "nothing loaded")
    for memory_obj in objects[keep:]:
        if memory_obj is not None:
            memory_obj.ref_count_down()
    del chunks[keep:]
    return objects[:keep]


def _write(engine: Any, connector: LayoutGPUConnector, job: LoadJob, chunks: Sequence[_Chunk],
           objects: Sequence[Any], arrived: torch.Tensor) -> LoadResult:
    """Each part's objects into the KV caches, inside the job's guard; corrupt objects removed. ``arrived``: the
    tokens the objects hold."""
    corrupt: list[_Chunk] = []
    result = LoadResult(arrived)

    def write() -> None:
        for part in dict.fromkeys(chunk.part_index for chunk in chunks):
            picked = [i for i, chunk in enumerate(chunks) if chunk.part_index == part]
            bad = connector.load_objects(part, [objects[i] for i in picked], [chunks[i].start for i in picked],
                                         [chunks[i].end for i in picked], job.block_ids, job.gate)
            if bad:
                corrupt.extend(chunks[picked[i]] for i in bad)
                return
            fmt = connector.part_format(part)
            result.chunks += len(picked) if connector.counts_chunks(part) else 0
            result.bytes += len(picked) * fmt.nbytes
            add_group_bytes(result.group_bytes, fmt, len(picked))

    if job.guard is None:
        write()
    else:
        job.guard.run(write)
    if corrupt:
        _discard(engine, job.req_id, corrupt)
        return LoadResult(torch.zeros_like(arrived), [chunk.key.to_string() for chunk in corrupt])
    return result


def _discard(engine: Any, req_id: str, corrupt: Sequence[_Chunk]) -> None:
    """Log and remove (every tier) the objects that failed their checksum."""
    for chunk in corrupt:
        removed = engine.storage_manager.remove(chunk.key)
        logger.error("request %s: LMCache object %s (tokens [%d, %d)) fails its checksum: the load reports no "
                     "token, and the object was removed (%d of its copies)", req_id, chunk.key.to_string(),
                     chunk.start, chunk.end, removed)


def _through_lmcache(engine: Any, job: LoadJob) -> LoadResult:
    """LMCache's own retrieve, the job as its keyword arguments."""
    kwargs: dict[str, Any] = {BLOCK_IDS: job.block_ids, "request_configs": dict(job.request_configs),
                              "req_id": job.req_id, "vllm_cached_tokens": job.vllm_cached_tokens}
    if job.gate is not None:
        kwargs[LAYER_GATE] = job.gate
    if job.guard is not None:
        kwargs[LOAD_GUARD] = job.guard
    arrived = engine.retrieve(job.tokens, job.mask, **kwargs)
    return LoadResult(arrived.to("cpu", torch.bool))
