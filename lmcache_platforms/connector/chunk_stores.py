"""One store of a request's computed tokens into LMCache's storage: a ``StoreJob`` goes down, a ``StoreResult``
comes back.

The job names everything the store needs (the tokens up to the store's end, which of them to store, every
group's block ids, the request's key configs, a layer gate, and for recurrent states the token counts where vLLM
kept one); nothing travels through LMCache's ``store`` signature or state set around a call, and what was
written comes back in the result instead of counters read before and after. The store:

1. keys the chunks of every part (``layout.parts``; whole chunks when the layout has none); a part carrying a
   recurrent state keys only the chunks ending where a state was kept (``state_ends``), since a state exists
   there only;
2. allocates each part's objects in LMCache's storage, in that part's own shape (LMCache would size them from
   its metadata, which knows one shape per engine); a store that runs out of memory keeps the chunks allocated
   before, as LMCache's own store does;
3. copies each part's chunks out of the KV caches (``LayoutGPUConnector.store_objects``: hashed as they are
   copied, layer by layer behind the job's gate) and puts them, one ``batched_put`` per part.

Anything else that stores through the engine (LMCache's offload server, tools) reaches the same function: with
chunks in parts, ``instance_adapter`` makes the engine's ``store`` build a job from its arguments.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from lmcache.utils import CacheStoreEvent

from lmcache_platforms.connector.binding import add_group_bytes
from lmcache_platforms.connector.paged import LayoutGPUConnector
from lmcache_platforms.connector.parts import objects_per_part, part_configs
from lmcache_platforms.connector.request import LAYER_GATE, ChunkJob, int64_tensor, required_block_ids
from lmcache_platforms.layout.parts import ChunkPart
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class StoreJob(ChunkJob):
    """One request's store (``ChunkJob``; the mask may leave out a prefix stored before). With ``state_ends``,
    a part carrying recurrent states (or, in whole chunks, any chunk) is stored only for the chunks ending
    there."""

    state_ends: Sequence[int] | None = None


@dataclass
class StoreResult:
    """What a store wrote: chunks (each counted once, by its widest part), the part of each object (None: a
    whole chunk), bytes, and bytes per KV-cache group."""

    chunks: int = 0
    objects: list[ChunkPart | None] = field(default_factory=list)
    bytes: int = 0
    group_bytes: dict[int, int] = field(default_factory=dict)


def store(engine: Any, job: StoreJob) -> StoreResult:
    """Store ``job`` through ``engine``, an LMCache engine whose GPU connector is ours."""
    connector = engine.gpu_connector
    if not isinstance(connector, LayoutGPUConnector):
        raise TypeError(f"chunk_stores stores through lmcache_platforms' paged connector, not "
                        f"{type(connector).__name__}")
    result = StoreResult()
    if not engine.is_healthy():
        logger.warning("request %s: LMCache is unhealthy: nothing stored", job.req_id)
        return result
    if (engine.save_only_first_rank and not engine.metadata.is_first_rank()) or engine.is_frozen():
        return result  # another rank stores (MLA), or LMCache's freeze mode
    wanted = job.wanted()
    stats = engine.stats_monitor.on_store_request(int(wanted.sum()))
    started = time.perf_counter()
    tokens = 0
    try:
        for part, chunks in _chunks(engine, connector.parts, job, wanted):
            index = None if part is None else part.index
            stored = _store_part(engine, connector, job, part, chunks)
            if not stored:
                break
            fmt = connector.part_format(index)
            counted = connector.counts_chunks(index)
            result.chunks += len(stored) if counted else 0
            tokens += sum(end - start for start, end, _ in stored) if counted else 0
            result.objects += [part] * len(stored)
            result.bytes += len(stored) * fmt.nbytes
            add_group_bytes(result.group_bytes, fmt, len(stored))
            if counted:
                _report_lmcache_events(engine, job.tokens, stored)
    finally:
        engine.stats_monitor.on_store_finished(stats, tokens)
    if result.objects:
        logger.info("request %s: stored %d objects (%s) for %d of %d tokens, %d bytes written, %.3f ms",
                    job.req_id, len(result.objects), objects_per_part(result.objects), tokens,
                    int(wanted.sum()), result.bytes, (time.perf_counter() - started) * 1000)
    return result


Chunk = tuple[int, int, Any]  # start, end, key


def _chunks(engine: Any, parts: Sequence[ChunkPart], job: StoreJob,
            wanted: torch.Tensor) -> list[tuple[ChunkPart | None, list[Chunk]]]:
    """Every object the store writes, part by part (None: whole chunks), in token order within each part."""
    database = engine.token_database
    keyed: list[tuple[ChunkPart | None, list[Chunk]]] = []
    for part in parts or (None,):
        configs = dict(job.request_configs) if part is None else part_configs(job.request_configs, part)
        chunks = [(start, end, key) for start, end, key in database.process_tokens(
            tokens=job.tokens, mask=wanted, request_configs=configs) if end > start]
        if job.state_ends is not None and (part is None or part.snapshots):
            ends = set(job.state_ends)
            chunks = [chunk for chunk in chunks if chunk[1] in ends]
        if chunks:
            keyed.append((part, chunks))
    return keyed


def _store_part(engine: Any, connector: LayoutGPUConnector, job: StoreJob, part: ChunkPart | None,
                chunks: list[Chunk]) -> list[Chunk]:
    """Allocate, copy and put one part's ``chunks``; the chunks stored (a prefix of them when memory ran out)."""
    index = None if part is None else part.index
    fmt = connector.part_format(index)
    busy_loop = engine.config.get_extra_config_value("force_store_wait", False)
    objects: list[Any] = []
    for _ in chunks:
        memory_obj = engine.storage_manager.allocate([fmt.shape], [fmt.dtype], fmt=engine.fmt, busy_loop=busy_loop)
        if memory_obj is None:
            logger.warning("request %s: LMCache's CPU memory is full: %d of %d chunks%s stored", job.req_id,
                           len(objects), len(chunks), "" if part is None else f" of part {part.name}")
            break
        objects.append(memory_obj)
    stored = chunks[: len(objects)]
    if not stored:
        return stored
    try:
        connector.store_objects(index, objects, [start for start, _, _ in stored], [end for _, end, _ in stored],
                                job.block_ids, job.gate)
    except BaseException:
        for memory_obj in objects:
            memory_obj.ref_count_down()
        raise
    engine.storage_manager.batched_put([key for _, _, key in stored], objects, location=engine.store_location)
    return stored


def _report_lmcache_events(engine: Any, tokens: torch.Tensor, stored: Sequence[Chunk]) -> None:
    """LMCache's own KV events (its ``enable_kv_events``, which vLLM's ``LMCacheConnectorV1`` publishes): one
    per chunk stored, chained by chunk hash as LMCache's store chains them."""
    if not engine.kv_events_enabled:
        return
    previous = 0
    for start, end, key in stored:
        engine.kv_events.append(CacheStoreEvent(
            block_hashes=[key.chunk_hash], parent_block_hash=None if start == 0 else previous,
            token_ids=tokens[start:end].tolist(), block_size=end - start, lora_id=None, medium=str(tokens.device),
            lora_name=None))
        previous = key.chunk_hash


def from_lmcache_arguments(tokens: Any = None, hashes: Any = None, offsets: Any = None, mask: Any = None,
                           state_ends: Sequence[int] | None = None, **kwargs: Any) -> StoreJob:
    """The job LMCache's ``store(tokens, hashes, offsets, mask, **kwargs)`` describes (its callers' keyword
    arguments, ``connector.request``); only tokens, not hashes, can key the parts of a chunk."""
    if tokens is None:
        raise ValueError("a store of chunks in parts needs the tokens, not their hashes")
    tokens = tokens if isinstance(tokens, torch.Tensor) else int64_tensor(list(tokens))
    return StoreJob(req_id=str(kwargs.get("req_id", "unspecified")), tokens=tokens,
                    block_ids=required_block_ids(kwargs), request_configs=kwargs.get("request_configs") or {},
                    mask=mask, gate=kwargs.get(LAYER_GATE), state_ends=state_ends)
