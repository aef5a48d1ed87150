"""Our engine impl's scheduler side: lookups (scoped; with snapshot groups, short of the last token), what vLLM
allocated, the per-step metadata with every group's block ids, and which loads failed.

It keeps upstream's methods with upstream's signatures (every wrapper of upstream's impl name calls them:
``wrapper_contract``) and gives our connector its own (``match``, ``after_alloc``), which carry loads that run
while their request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` state.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from lmcache.integration.vllm.utils import apply_mm_hashes_to_token_ids, extract_mm_features
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata, extract_request_configs

from lmcache_platforms.integration.vllm.impl_state import ImplState
from lmcache_platforms.integration.vllm.lookup_span import LookupRules, hit_span
from lmcache_platforms.integration.vllm.request_meta import LoadSpec, RequestMeta, build_request_meta
from lmcache_platforms.integration.vllm.request_scope import scoped_configs
from lmcache_platforms.integration.vllm.tracker import RequestTracker, block_ids_per_group
from lmcache_platforms.integration.vllm.vllm_compat import failed_loads, resumed_from_preemption
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)

_policy_warned = False


def warn_about_failure_policy(vllm_config: VllmConfig, hits_allowed: bool) -> None:
    """Once per process: vLLM's default ``kv_load_failure_policy`` ("fail") ends a request whose load failed,
    though LMCache can always recompute it; say how to choose recomputation."""
    global _policy_warned
    policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", None)
    if _policy_warned or not hits_allowed or policy != "fail":
        return
    _policy_warned = True
    logger.warning("kv_load_failure_policy is 'fail' (vLLM's default): a request whose LMCache load fails "
                   "(evicted chunk, unreachable or corrupt remote store) ends with an error instead of being "
                   "recomputed. Add \"kv_load_failure_policy\": \"recompute\" to --kv-transfer-config to serve "
                   "it anyway.")


class SchedulerSide(ImplState):
    """What vLLM's scheduler calls: lookups, allocation, per-step metadata, transfer outcomes, finished requests."""

    def _init_connector_state(self, role: KVConnectorRole, vllm_config: VllmConfig,
                              config: LMCacheEngineConfig) -> None:
        super()._init_connector_state(role, vllm_config, config)
        # Wait-state loads to send with this step's metadata, what each loaded, which failed.
        self._wait_loads: dict[str, RequestMeta] = {}
        self._loaded_while_waiting: dict[str, int] = {}
        self._failed_loads: set[str] = set()
        # Each request's chunk configs as of its latest lookup (request_scope.py).
        self._configs: dict[str, dict[str, Any]] = {}
        self._lookup_rules = LookupRules(
            chunk_size=self._lmcache_chunk_size, skip_last_n_tokens=self.skip_last_n_tokens,
            min_retrieve_tokens=config.min_retrieve_tokens, max_tokens_per_load=self._max_tokens_per_load,
            stop_before_last_chunk_end=bool(self.plan.snapshot_groups))

    def _request_configs(self, request: Request) -> dict[str, Any]:
        """What keys this request's chunks besides its tokens (its LMCache request configs and its scope), as
        of its latest lookup: a load must use the generation its hit was found in."""
        configs = self._configs.get(request.request_id)
        if configs is None:
            configs = scoped_configs(request, extract_request_configs(request.sampling_params), self._generation)
        return configs

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Upstream's contract (every upstream wrapper calls this): LMCache's hit beyond vLLM's own, a count. The
        lookup carries the request's scope (``request_scope``) and the tokens ``LookupRules`` allows. A request
        whose load failed once is recomputed: a second lookup would find the same broken chunk."""
        req_id = request.request_id
        configs = scoped_configs(request, extract_request_configs(request.sampling_params), self._generation)
        self._configs[req_id] = configs
        client = self.lookup_client
        if (client is None or not self.hits_allowed or req_id in self._failed_loads or req_id.startswith("mock_req")
                or (self.kv_role == "kv_producer" and not hasattr(client, "supports_producer_reuse"))):
            return 0
        hit = client.lookup_cache(lookup_id=req_id)  # -1: not asked yet; None: an asynchronous lookup under way
        if hit == -1:
            self._requests_priority[req_id] = getattr(request, "priority", 0)
            tokens = self._lookup_rules.tokens(self._lookup_tokens(request), request.num_tokens)
            hit = client.lookup(tokens, lookup_id=req_id, request_configs=configs)
        if hit is None:
            return None
        span = hit_span(self._lookup_rules, hit, num_computed_tokens, request.num_tokens)
        logger.info("request %s: %d tokens, vLLM holds %d, LMCache holds %d: %d to load", req_id,
                    request.num_tokens, num_computed_tokens, hit, span.allocate)
        self.load_specs[req_id] = LoadSpec(num_computed_tokens, span.load_end)
        return span.allocate

    @staticmethod
    def _lookup_tokens(request: Request) -> list[int]:
        """The request's tokens as LMCache keys them: every token so far (a preempted request's too), a
        multimodal prompt's placeholders replaced by its items' hashes."""
        mm_hashes, mm_positions = extract_mm_features(request)
        if not (mm_hashes and mm_positions):
            return list(request.all_token_ids)
        tokens = torch.tensor(request.prompt_token_ids)
        apply_mm_hashes_to_token_ids(tokens, mm_hashes, mm_positions)
        return tokens.tolist()

    def match(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Our connector's call: the hit, and whether it loads while the request waits."""
        tokens = self.get_num_new_matched_tokens(request, num_computed_tokens)
        return tokens, bool(tokens) and self.waits_for_loads

    def update_state_after_alloc(self, request: Request, num_external_tokens: int) -> None:
        """Upstream's contract (no blocks: a load runs in the step that computes the request); counts the
        lookup and the hit vLLM took (once per scheduled request, unlike the lookup, which vLLM may repeat)."""
        super().update_state_after_alloc(request, num_external_tokens)
        self.stats.count("lookups")
        self.stats.count("hit_tokens", num_external_tokens)

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Our connector's call (upstream wrappers call ``update_state_after_alloc``, which gets no blocks):
        upstream's bookkeeping; a load that waits is described now, with every group's blocks, and goes to the
        workers with this step's metadata (vLLM schedules the request only once it is reported)."""
        self.update_state_after_alloc(request, num_external_tokens)
        req_id = request.request_id
        spec = self.load_specs.get(req_id)
        if not self.waits_for_loads or spec is None or not spec.can_load:
            return
        del self.load_specs[req_id]
        # Only the hit: vLLM allocated blocks for it alone, and no step computes this request now (so a
        # snapshot group's hit-point block, which vLLM copies forward itself, is where its state goes).
        hit = spec.lmcache_cached_tokens
        tracker = RequestTracker(
            req_id=req_id, prompt_len=request.num_prompt_tokens, token_ids=list(request.all_token_ids[:hit]),
            block_ids=block_ids_per_group(blocks.get_block_ids(), len(self.plan.groups)),
            request_configs=self._request_configs(request))
        tracker.mm_hashes, tracker.mm_positions = extract_mm_features(request)
        meta = build_request_meta(tracker, self.plan, self._lmcache_chunk_size, force_skip_save=True,
                                  load_spec=LoadSpec(spec.vllm_cached_tokens, hit, True))
        assert meta is not None
        meta.load_while_waiting = True
        self._wait_loads[req_id] = meta
        self._loaded_while_waiting[req_id] = hit

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Scheduler side: remember failed wait-state loads, so the request is recomputed and saved anew; turn
        what the workers stored into KV events (the request may have finished this step: it is still known)."""
        self.kv_events.stored(getattr(connector_output, "kv_cache_events", None), self._unfinished_requests)
        for req_id in failed_loads(connector_output):
            self._failed_loads.add(req_id)
            self._loaded_while_waiting[req_id] = 0

    def _loaded_tokens(self, req_id: str, load_spec: LoadSpec | None) -> int:
        """Tokens LMCache holds for a request scheduled now: this step's load, or one done while it waited."""
        waited = self._loaded_while_waiting.pop(req_id, 0)
        return load_spec.lmcache_cached_tokens if load_spec is not None else waited

    def _pop_load_spec(self, req_id: str) -> LoadSpec | None:
        spec = self.load_specs.pop(req_id, None)
        if spec is None:
            return None
        return LoadSpec(spec.vllm_cached_tokens, spec.lmcache_cached_tokens, spec.can_load)

    def _meta(self, tracker: RequestTracker, load_spec: LoadSpec | None) -> RequestMeta | None:
        return build_request_meta(
            tracker, self.plan, self._lmcache_chunk_size, load_spec=load_spec,
            discard_partial_chunks=self._discard_partial_chunks,
            save_decode_cache=self.config.save_decode_cache,
            force_skip_save=self.kv_role == "kv_consumer" or self.force_skip_save,
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> LMCacheConnectorMetadata:
        meta = LMCacheConnectorMetadata()
        if self.lookup_client is None:
            return meta
        for req_id in scheduler_output.finished_req_ids:
            self._configs.pop(req_id, None)
            self._request_trackers.pop(req_id, None)
            self._unfinished_requests.pop(req_id, None)
            self.kv_events.finished(req_id)
        num_groups = len(self.plan.groups)
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id.startswith("mock_req"):
                continue
            request = self._unfinished_requests.get(new.req_id)
            if request is None:
                raise ValueError(f"request {new.req_id} is scheduled but vLLM never allocated its blocks")
            load_spec = self._pop_load_spec(new.req_id)
            priority = self._requests_priority.pop(new.req_id, 0)
            limit = self.config.priority_limit
            tracker = RequestTracker.from_new_request(
                new, num_groups,
                num_tokens_to_compute=new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id],
                lmcache_cached_tokens=self._loaded_tokens(new.req_id, load_spec),
                skip_save=limit is not None and priority > limit,
                request_configs=self._request_configs(request),
            )
            if getattr(new, "mm_features", None):
                tracker.mm_hashes, tracker.mm_positions = extract_mm_features(new, modify=True)
            self._request_trackers[new.req_id] = tracker
            self._add(meta, self._meta(tracker, load_spec))
        cached = scheduler_output.scheduled_cached_reqs
        for index, req_id in enumerate(cached.req_ids):
            self._add(meta, self._update_cached(scheduler_output, cached, index, req_id))
        for request in self._wait_loads.values():
            meta.add_request(request)
        self._wait_loads.clear()
        return meta

    @staticmethod
    def _add(meta: LMCacheConnectorMetadata, request: RequestMeta | None) -> None:
        if request is not None:
            meta.add_request(request)

    def _update_cached(self, scheduler_output: SchedulerOutput, cached: CachedRequestData, index: int,
                       req_id: str) -> RequestMeta | None:
        tracker = self._request_trackers.get(req_id)
        request = self._unfinished_requests.get(req_id)
        if tracker is None or request is None:
            raise ValueError(f"request {req_id} is scheduled again but was never seen as a new request")
        num_new = scheduler_output.num_scheduled_tokens[req_id]
        load_spec = self._pop_load_spec(req_id)
        new_block_ids = cached.new_block_ids[index]
        num_computed = request.num_computed_tokens
        if resumed_from_preemption(cached, index, req_id):
            tracker.request_configs = self._request_configs(request)  # looked up again: maybe after a reset
            tracker.resume(request.all_token_ids, new_block_ids, num_computed, num_new,
                           self._loaded_tokens(req_id, load_spec))
        else:
            if num_computed < len(tracker.token_ids):
                logger.warning("request %s rolled back from %d to %d tokens (a failed load is recomputed)",
                               req_id, len(tracker.token_ids), num_computed)
                tracker.roll_back(num_computed, request.all_token_ids)
            base = min(num_computed, len(tracker.token_ids))
            tracker.append(list(request.all_token_ids[base : base + num_new]), new_block_ids)
        return self._meta(tracker, load_spec)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        """vLLM's HMA hook: saving is synchronous (wait_for_save), so blocks can be freed at once. (A request
        finished while its load waits keeps its blocks until the load is reported: vLLM sees to that.)"""
        req_id = request.request_id
        self._configs.pop(req_id, None)
        self._failed_loads.discard(req_id)
        self._loaded_while_waiting.pop(req_id, None)
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

