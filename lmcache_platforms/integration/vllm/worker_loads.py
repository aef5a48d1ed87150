"""Our engine impl's worker side, its loads: in the step that computes a request, or while it waits
(``async_loads``), each with every group's block ids and the key tags, counted in the statistics.

Layerwise mode (LMCache's ``use_layerwise``): a load in the step that computes its request runs on the loader
thread layer by layer, and the forward waits for one layer at a time (``wait_for_layer_load``); layers the
forward never waits for (vLLM calls the hooks from its attention ops only: recurrent, indexer layers) are waited
for before the forward starts. A load while its request waits has no forward of its own to overlap and stays
whole. The hand-over is ``connector.layer_gate``.

While the KV caches are unregistered (vLLM sleep mode, ``lifecycle``) a load is reported failed: nothing is
copied into memory that may be unmapped.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

from lmcache_platforms.connector.chunk_loads import LoadJob
from lmcache_platforms.connector.chunk_loads import load as load_chunks
from lmcache_platforms.connector.instance_adapter import with_tags
from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.connector.poison import poison_blocks
from lmcache_platforms.connector.request import int64_tensor
from lmcache_platforms.connector.tier_watch import listen
from lmcache_platforms.integration.vllm import vllm_compat
from lmcache_platforms.integration.vllm.async_loads import LoadGuard, LoadResults, StartedLoad
from lmcache_platforms.integration.vllm.impl_state import ImplState
from lmcache_platforms.integration.vllm.request_meta import RequestMeta
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.config import LMCacheEngineConfig
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.forward_context import ForwardContext

logger = init_logger(__name__)


@dataclass
class _LayerwiseLoad:
    """A load in the step that computes its request, layer by layer: its gate and its outcome."""

    request: RequestMeta
    gate: LayerGate
    job: StartedLoad[int | None]


class WorkerLoads(ImplState):
    """What vLLM's workers call each step to load: bind the step's metadata, load (in the step or while the
    request waits, paged or layer by layer), report failed and finished loads."""

    _layerwise_loads: list[_LayerwiseLoad]
    _reads_heard: bool

    def _init_connector_state(self, role: KVConnectorRole, vllm_config: VllmConfig,
                              config: LMCacheEngineConfig) -> None:
        super()._init_connector_state(role, vllm_config, config)
        self._layerwise_loads = []
        self._reads_heard = False

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Per-step state is reset here: vLLM 0.32+ calls start_load_kv only on steps with synchronous loads."""
        self.current_layer = 0
        self.layerwise_retrievers = []

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.current_layer = 0
        engine = self.lmcache_engine
        if engine is None:
            return
        metadata = self._parent._get_connector_metadata()
        for request in metadata.requests:
            spec = request.load_spec
            if spec is None or not spec.can_load:
                continue
            if self._kv_unregistered:
                self._skip_load(engine, request)
                continue
            self._poison(request)
            if request.load_while_waiting:
                self.loads.submit(request.req_id, partial(self._load_waiting, engine, request),
                                  wait=self.settings.load_mode == "sync")
            elif self.layerwise and (binding := self._binding()) is not None:
                gate = LayerGate(binding.moved_layers)
                job = self.loads.start(request.req_id, partial(self._load_one, engine, request, gate=gate))
                self._layerwise_loads.append(_LayerwiseLoad(request, gate, job))
            else:
                job = self.loads.start(request.req_id, partial(self._load_one, engine, request))
                first = job.result(on_failure=spec.vllm_cached_tokens)
                if first is not None:
                    self._fail_load(request, first, spec.lmcache_cached_tokens, job.guard.cause)
        if self._layerwise_loads and (binding := self._binding()) is not None:
            hooked = vllm_compat.layers_with_transfer_hooks(forward_context)
            for name in binding.moved_layers:
                if name not in hooked:
                    self.wait_for_layer_load(name)

    def _poison(self, request: RequestMeta) -> None:
        """``platforms.poison_loads`` (tests only): the request's blocks past vLLM's own hit are filled with random
        values here, before the step's forward and before the load starts, so that nothing but the load and the
        forward's own writes of new tokens can leave right bytes in them."""
        if not self.settings.poison_loads:
            return
        binding, spec = self._binding(), request.load_spec
        if binding is None or spec is None:
            return
        try:
            blocks = request.blocks_not_held(spec.vllm_cached_tokens, spec.lmcache_cached_tokens)
        except ValueError:
            return  # no block to load into: the load itself reports it
        poison_blocks(binding.layout, blocks, seed=zlib.crc32(request.req_id.encode()))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """The forward is about to read ``layer_name``: wait until every load of this step wrote it (a load past
        its deadline is given up: its blocks are reported failed, so what it left is never used)."""
        if not self._layerwise_loads:
            return
        binding = self._binding()
        for load in self._layerwise_loads:
            ready, event = load.gate.wait(layer_name, load.job.deadline)
            if not ready:
                load.job.give_up()
                load.gate.release()
            elif binding is not None:
                binding.streams.compute_after(event)

    def _finish_layerwise_loads(self) -> None:
        """After the forward: each layerwise load's outcome, a short one reported as in the paged mode."""
        loads, self._layerwise_loads = self._layerwise_loads, []
        for load in loads:
            spec = load.request.load_spec
            assert spec is not None
            first = load.job.result(on_failure=spec.vllm_cached_tokens)
            load.gate.release()
            if first is not None:
                self._fail_load(load.request, first, spec.lmcache_cached_tokens, load.job.guard.cause)

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layerwise_loads()
        return super().get_block_ids_with_load_errors()

    def _skip_load(self, engine: LMCacheEngine, request: RequestMeta) -> None:
        """A load while the KV caches are unregistered (vLLM stepped before restore_kv_caches): nothing is
        copied into memory that may be unmapped, and the load is reported failed (per request, or per block for
        a single-group model's same-step load), so vLLM recomputes rather than decode from rows never loaded."""
        spec = request.load_spec
        assert spec is not None
        engine.lookup_unpin(request.req_id)
        logger.error("request %s: not loading tokens [%d, %d): the KV caches are unregistered (vLLM sleep mode) "
                     "and restore_kv_caches was not called", request.req_id, spec.vllm_cached_tokens,
                     spec.lmcache_cached_tokens)
        if request.load_while_waiting:
            self.loads.fail(request.req_id)
        else:
            self._fail_load(request, spec.vllm_cached_tokens, spec.lmcache_cached_tokens, "unregistered")

    def _hear_reads(self, engine: LMCacheEngine) -> None:
        """From this worker's first load on, count the bytes each storage tier serves it
        (``connector.tier_watch``)."""
        if self._reads_heard:
            return
        self._reads_heard = True
        stats = self.stats

        def read(tier: str, objects: list[Any]) -> None:
            stats.count_labelled("tier_bytes_read", {tier: sum(o.get_size() for o in objects if o is not None)})

        listen(engine.storage_manager, "stats", read)

    def _load_waiting(self, engine: LMCacheEngine, request: RequestMeta, _req_id: str, guard: LoadGuard) -> bool:
        """A load while its request waits (``AsyncLoads.submit``): whether every token arrived intact."""
        return self._load_one(engine, request, guard) is None

    def _load_one(self, engine: LMCacheEngine, request: RequestMeta, guard: LoadGuard,
                  gate: LayerGate | None = None) -> int | None:
        """Retrieve one request's hit into its blocks; the first token that did not arrive intact, or None.
        Runs on the loader thread; never raises for a load that came back short. With ``gate``, layer by layer;
        the gate is released when the load ends, however it ends."""
        spec = request.load_spec
        assert spec is not None
        num_tokens = spec.lmcache_cached_tokens
        if len(request.token_ids) < num_tokens:
            raise RuntimeError(f"request {request.req_id}: {num_tokens} tokens to load but only "
                               f"{len(request.token_ids)} token ids tracked")
        chunk = self._lmcache_chunk_size
        mask = torch.ones(num_tokens, dtype=torch.bool)
        skipped = spec.vllm_cached_tokens // chunk * chunk
        mask[:skipped] = False
        self._stats_monitor.update_interval_vllm_hit_tokens(spec.vllm_cached_tokens)
        self._stats_monitor.update_interval_prompt_tokens(len(request.token_ids))
        self._hear_reads(engine)
        job = LoadJob(req_id=request.req_id, tokens=int64_tensor(request.token_ids[:num_tokens]), mask=mask,
                      block_ids=request.blocks_not_held(spec.vllm_cached_tokens, num_tokens),
                      request_configs=with_tags(request.request_configs, self._key_tags), gate=gate, guard=guard,
                      vllm_cached_tokens=spec.vllm_cached_tokens)
        started = time.perf_counter()
        result = None
        try:
            result = load_chunks(engine, job)
        finally:
            if gate is not None:
                gate.release()
            engine.lookup_unpin(request.req_id)
            self.stats.timing("load_seconds", time.perf_counter() - started)
            if result is not None:
                self.stats.count("bytes_loaded", result.bytes)
                self.stats.count("chunks_loaded", result.chunks)
                self.stats.count_labelled("group_bytes_loaded", result.group_bytes)
        if guard.failure is not None:
            logger.error("request %s: LMCache load of %d tokens failed: %s", request.req_id, int(mask.sum()),
                         guard.failure)
            return skipped
        missing = mask & ~result.arrived
        if not bool(missing.any()):
            logger.info("request %s: loaded tokens [%d, %d) from LMCache, %d bytes read%s", request.req_id,
                        skipped, num_tokens, result.bytes, ", layer by layer" if gate is not None else "")
            return None
        first = int(torch.nonzero(missing)[0])
        guard.failed("corrupt" if result.corrupt else "missing")
        logger.error("request %s: LMCache returned %d of %d expected tokens; failed from token %d",
                     request.req_id, int((mask & result.arrived).sum()), int(mask.sum()), first)
        return first

    def _fail_load(self, request: RequestMeta, first: int, num_tokens: int, cause: str | None) -> None:
        """A single-group model's synchronous load did not fully arrive: its blocks holding tokens
        ``[first, num_tokens)`` go to vLLM, which recomputes or fails the request."""
        self.stats.failed_load(cause or "error")
        if self.plan.multi_group:
            raise RuntimeError(
                f"request {request.req_id}: a load of a model with {len(self.plan.saved)} KV-cache groups ran in "
                "the step that computes it, where vLLM cannot be told it failed (this vLLM has no "
                f"failed_recving); tokens [{first}, {num_tokens}) never arrived")
        self._invalid_block_ids.update(request.failed_blocks(first, num_tokens))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Upstream's contract, called by the upstream connector names each step: nothing to report (their loads
        run in the step), finished requests' pins released (``release_finished``)."""
        self.release_finished(finished_req_ids)
        return None, None

    def release_finished(self, finished_req_ids: set[str]) -> None:
        """Unpin what finished requests' lookups still hold. Upstream unpins a request's chunks only in a step
        that schedules it, so a request that ended without one (its client aborted it while it waited for
        blocks) kept them pinned for ever: found by the fuzzer under a tight KV cache. A request whose
        wait-state load is not reported yet keeps them; that load's end releases them."""
        engine = self.lmcache_engine
        if engine is None:
            return
        for req_id in finished_req_ids:
            if not self.loads.holds(req_id):
                engine.lookup_unpin(req_id)

    def get_transfer_results(self, finished_req_ids: set[str]) -> LoadResults:
        """Wait-state loads that ended since the last step (failed ones are also in ``finished``); finished
        requests' pins released (``release_finished``)."""
        self.release_finished(finished_req_ids)
        results = self.loads.poll()
        for cause in results.causes.values():
            self.stats.failed_load(cause)
        return results
