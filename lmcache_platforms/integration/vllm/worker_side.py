"""Our engine impl's worker side: its saves, on top of its loads (``worker_loads``). Each save carries every
group's block ids and the key tags, is counted in the statistics and reported to the KV events.

Layerwise mode (LMCache's ``use_layerwise``): the chunk objects are the paged mode's (a chunk stored in one mode
is a hit in the other); what changes is when bytes move. A step's saves run on a store thread that copies each
layer as soon as the forward marks it written (``save_kv_layer``), and ``wait_for_save`` waits for the rest,
after the step's layer-by-layer loads ended (a save never unpins chunks a same-step load still reads).

While the KV caches are unregistered (vLLM sleep mode, ``lifecycle``) a save is skipped (logged once per sleep).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from lmcache_platforms.connector.chunk_stores import StoreJob
from lmcache_platforms.connector.chunk_stores import store as store_chunks
from lmcache_platforms.connector.instance_adapter import with_tags
from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.connector.request import int64_tensor
from lmcache_platforms.connector.tier_watch import listen
from lmcache_platforms.integration.vllm.kv_events import (
    ChunkId,
    RemovedChunk,
    StoredPrefix,
    StoredPrefixes,
    Tier,
    chunk_id,
    local_tiers,
)
from lmcache_platforms.integration.vllm.request_meta import RequestMeta
from lmcache_platforms.integration.vllm.worker_loads import WorkerLoads
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.config import LMCacheEngineConfig
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

logger = init_logger(__name__)


class WorkerSide(WorkerLoads):
    """What vLLM's workers call each step: the loads of ``WorkerLoads``, and the saves."""

    _store_job: tuple[LayerGate, Future[None], frozenset[str]] | None
    """This step's saves on the store thread: their gate, their outcome, and the requests whose lookup pins they
    leave (a same-step load of theirs may still be reading the pinned chunks): unpinned once the loads ended."""
    _store_thread: ThreadPoolExecutor | None
    _stored_prefixes: deque[StoredPrefix | RemovedChunk] | None
    """What this worker's stores made hits, and what its local tiers dropped, since vLLM last took its KV events
    (None: vLLM publishes none); the store thread appends while vLLM may take (when it finishes a step's saves
    later)."""
    _removals_heard: bool

    def _init_connector_state(self, role: KVConnectorRole, vllm_config: VllmConfig,
                              config: LMCacheEngineConfig) -> None:
        super()._init_connector_state(role, vllm_config, config)
        self._store_job = None
        self._store_thread = None
        self._stored_prefixes = deque() if self.kv_events.enabled else None
        self._removals_heard = False

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        """Layerwise mode: ``layer_name``'s KV is written; the step's saves (started by the first layer) may copy
        it now. ``kv_layer`` is not read: the planes come from the bound layout."""
        if not self.layerwise:
            return
        engine = self.lmcache_engine
        binding = self._binding()
        if engine is None or binding is None:
            return
        if self._store_job is None:
            if self._store_thread is None:
                self._store_thread = ThreadPoolExecutor(1, thread_name_prefix="lmcache-platforms-store")
            gate = LayerGate(binding.moved_layers)
            metadata = self._parent._get_connector_metadata()
            loading = frozenset(load.request.req_id for load in self._layerwise_loads)
            self._store_job = gate, self._store_thread.submit(self._save_requests, engine, metadata, gate,
                                                              loading), loading
        self._store_job[0].mark(layer_name, binding.streams.forward_event())

    def wait_for_save(self) -> None:
        engine = self.lmcache_engine
        if engine is None:
            return
        self._finish_layerwise_loads()
        job, self._store_job = self._store_job, None
        if job is not None:
            gate, saving, loaded = job
            gate.release()  # the forward is over: every layer's KV is written
            saving.result()
            for req_id in loaded:
                engine.lookup_unpin(req_id)
            return
        self._save_requests(engine, self._parent._get_connector_metadata())

    def _save_requests(self, engine: LMCacheEngine, metadata: Any, gate: LayerGate | None = None,
                       keep_pins: frozenset[str] = frozenset()) -> None:
        """Save what this step computed of every request (with ``gate``: layer by layer, on the store thread),
        unpinning its lookup's chunks but for ``keep_pins``."""
        for request in metadata.requests:
            if request.load_while_waiting:
                continue  # its load (maybe still running) releases its pins; it saves once scheduled
            if request.req_id not in keep_pins:
                engine.lookup_unpin(request.req_id)
            if self.kv_role == "kv_consumer":
                continue
            if self._kv_unregistered:
                self._log_skipped_save(request.req_id)
                continue
            spec = request.save_spec
            if spec is None or not spec.can_save:
                continue
            start = spec.skip_leading_tokens // self._lmcache_chunk_size * self._lmcache_chunk_size
            end = spec.num_tokens
            if start >= end:
                continue
            mask = torch.ones(end, dtype=torch.bool)
            mask[:start] = False
            if self._binding() is None:
                continue
            started = time.perf_counter()
            self._hear_removals(engine)
            job = self._store_job_of(request, mask, gate)
            result = store_chunks(engine, job)
            self.stats.timing("store_seconds", time.perf_counter() - started)
            self.stats.count("bytes_stored", result.bytes)
            self.stats.count("chunks_stored", result.chunks)
            self.stats.count_labelled("group_bytes_stored", result.group_bytes)
            self._report_stored(engine, request, start, end, result.chunks, dict(job.request_configs))
            if result.bytes:
                states = f", recurrent state at {list(request.state_ends)}" if self.plan.snapshot_groups else ""
                logger.info("request %s: stored tokens [%d, %d) in LMCache, %d bytes written%s%s", request.req_id,
                            start, end, result.bytes, states, ", layer by layer" if gate is not None else "")

    def _store_job_of(self, request: RequestMeta, mask: torch.Tensor, gate: LayerGate | None) -> StoreJob:
        """The store of ``request``'s tokens ``mask`` marks, with every group's block ids and the key tags; a
        chunk's recurrent state exists only at ``request.state_ends`` (``chunk_stores``)."""
        return StoreJob(req_id=request.req_id, tokens=int64_tensor(request.token_ids[:len(mask)]),
                        block_ids=request.block_ids, request_configs=with_tags(request.request_configs,
                                                                               self._key_tags),
                        mask=mask, gate=gate, state_ends=request.state_ends if self.plan.snapshot_groups else None)

    def _hear_removals(self, engine: LMCacheEngine) -> None:
        """For the KV events: from this worker's first save on, report what its engine's local tiers drop
        (``connector.tier_watch``); nothing they drop before was stored by a save of this worker."""
        reports = self._stored_prefixes
        if reports is None or self._removals_heard:
            return
        self._removals_heard = True

        def report(tier: Tier) -> Callable[[Any], None]:
            return lambda key: reports.append(RemovedChunk(chunk_id(key), tier.medium, tier.locality))

        for backend, tier in local_tiers(engine.storage_manager.storage_backends):
            listen(backend, "kv-events", report(tier))

    def _report_stored(self, engine: LMCacheEngine, request: RequestMeta, start: int, end: int, chunks: int,
                       request_configs: dict[str, Any] | None) -> None:
        """For the KV events: the prefix a store of ``chunks`` chunks from ``start`` made a hit, and the chunks
        written (keyed as the store keyed them, with ``request_configs``). LMCache writes a store's chunks in
        order and stops early only when its memory runs out; with recurrent states a hit ends where a state was
        kept."""
        if self._stored_prefixes is None or not chunks:
            return
        if self.plan.snapshot_groups:
            ends = [state_end for state_end in request.state_ends if start < state_end <= end]
            if not ends:
                return
            reached = max(ends)
        else:
            reached = min(end, start + chunks * self._lmcache_chunk_size)
        tokens = request.token_ids[:reached]
        mask = torch.ones(len(tokens), dtype=torch.bool)
        mask[:start] = False
        written: tuple[tuple[int, int, ChunkId], ...] = tuple(
            (first, last, chunk_id(key)) for first, last, key in
            engine.token_database.process_tokens(tokens=tokens, mask=mask, request_configs=request_configs))
        self._stored_prefixes.append(StoredPrefix(request.req_id, start, reached, written))

    def take_stored_prefixes(self) -> StoredPrefixes | None:
        """This worker's reports since the last call, for vLLM to gather (``get_kv_connector_kv_cache_events``)."""
        reports = []
        while self._stored_prefixes:
            reports.append(self._stored_prefixes.popleft())
        return StoredPrefixes(reports) if reports else None

    def _log_skipped_save(self, req_id: str) -> None:
        """A skipped save costs a future cache miss only, so it is logged (once per sleep), not raised."""
        if self._skips_logged:
            logger.debug("request %s: not saved, the KV caches are unregistered", req_id)
            return
        self._skips_logged = True
        logger.warning("request %s: not saving to LMCache: the KV caches are unregistered (vLLM sleep mode) and "
                       "restore_kv_caches was not called; saves are skipped until it is", req_id)
