"""The in-process LMCache engine impl for vLLM, for every KV-cache group (replaces ``LMCacheConnectorV1Impl``).

It keeps upstream's engine life cycle (config, ``LMCacheManager``, lookup client/server, abort clean-up)
and replaces what assumed one group: the request tracker, the per-step metadata, loading, saving and
failed-block reporting. Rules on top of upstream's:
  - more than one saved group => only whole chunks are saved;
  - a group we can neither restore nor prove unnecessary => no hit is ever claimed (and nothing saved);
  - a recurrent group in vLLM's align mode travels as one state snapshot per chunk, so hits end on chunk
    boundaries, and a load writes the snapshot into the block vLLM resumes from (``request_meta.py``);
  - a hit is loaded while its request waits in vLLM's ``WAITING_FOR_REMOTE_KVS`` state (``async_loads``)
    whenever the load mode is ``async`` or several groups are saved (in ``sync`` the step waits for that
    load, bounded by ``load_timeout_s``), and a load that came back short is
    reported for that request alone (``failed_recving``): vLLM recomputes it or fails it, per its
    ``kv_load_failure_policy``, and the engine stays up. Only a single-group model in ``sync`` mode loads
    in the step that computes it, reporting failed blocks with the group's block size (vLLM refuses block
    reports when there are several groups);
  - degraded mode (engine init failed) is logged as an error and reported by ``health.engine_health``;
  - every chunk key carries the request's scope (LoRA adapter, cache_salt, the generation a prefix-cache reset
    bumps: ``request_scope``) and the model's identity (``model_identity``), besides the layout fingerprint;
  - vLLM 0.33 sleep mode: between ``unregister_kv_caches`` and ``restore_kv_caches`` nothing of ours touches
    the KV tensors (a save is skipped, a load reported failed), and restore checks they did not move.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from lmcache.integration.vllm.utils import extract_mm_features
from lmcache.integration.vllm.vllm_v1_adapter import (
    LMCacheConnectorMetadata,
    LMCacheConnectorV1Impl,
    extract_request_configs,
)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_platforms.config import PlatformSettings, connector_settings
from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.connector.chunk_format import layout_fingerprint, paged_format
from lmcache_platforms.connector.factory import layout_engine
from lmcache_platforms.connector.parts import install_parts
from lmcache_platforms.connector.protocol import LayoutConnector
from lmcache_platforms.integration.vllm import health
from lmcache_platforms.integration.vllm.async_loads import AsyncLoads, LoadGuard, LoadResults
from lmcache_platforms.integration.vllm.exit_shutdown import shut_down_at_exit
from lmcache_platforms.integration.vllm.groups import GroupPlan, plan_groups, single_group_plan
from lmcache_platforms.integration.vllm.key_tags import tag_engine_lookups, with_tags
from lmcache_platforms.integration.vllm.model_identity import MODEL_TAG, model_identity
from lmcache_platforms.integration.vllm.pending_writes import drain_writes
from lmcache_platforms.integration.vllm.recurrent import StepSettings
from lmcache_platforms.integration.vllm.registered_layout import build_layout, cache_dtype_tags, vllm_hint_for
from lmcache_platforms.integration.vllm.request_meta import LoadSpec, RequestMeta, build_request_meta
from lmcache_platforms.integration.vllm.request_scope import ScopedLookups, looking_up, scoped_configs
from lmcache_platforms.integration.vllm.stats import StatsRecorder
from lmcache_platforms.integration.vllm.tracker import RequestTracker, block_ids_per_group
from lmcache_platforms.integration.vllm.wrapper_contract import contract_of
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from lmcache.v1.cache_engine import LMCacheEngine
    from lmcache.v1.config import LMCacheEngineConfig
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


logger = init_logger(__name__)



class KVCacheMovedError(RuntimeError):
    """After vLLM's wake-up a KV cache tensor is no longer where it was bound, and cannot be rebound."""


Signature = tuple[tuple[int, tuple[int, ...], tuple[int, ...], str, str], ...]


def _tensors(value: Any) -> list[torch.Tensor]:
    """A registered layer's tensors: one tensor, or (vLLM 0.23 / vllm-ascend) a tuple or list of them."""
    return [value] if isinstance(value, torch.Tensor) else [t for item in value for t in _tensors(item)]


def kv_signature(value: Any) -> Signature:
    """What a layer's bound planes depend on: each tensor's address, shape, strides, dtype and device."""
    return tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
                 for t in _tensors(value))


def moved_layers(bound: Mapping[str, Signature], kv_caches: Mapping[str, Any]) -> dict[str, str]:
    """Layer name -> how its tensors differ from what was bound (only the layers that differ)."""
    moved = {}
    for name, was in bound.items():
        value = kv_caches.get(name)
        now = kv_signature(value) if value is not None else None
        if now != was:
            moved[name] = "gone" if now is None else f"was {_describe(was)}, now {_describe(now)}"
    return moved


def _describe(signature: Signature) -> str:
    return "; ".join(f"{hex(ptr)} {list(shape)} {dtype} on {device}" for ptr, shape, _, dtype, device in signature)


def _bind(connector: LayoutConnector, layout: KVLayout, split: bool) -> LayoutBinding:
    """Bind ``layout`` to our GPU connector (its chunks ``split`` into parts or whole); the binding it made."""
    connector.bind(layout, split=split)
    assert connector.binding is not None  # bind always sets it
    return connector.binding


def whole_chunk_reader(lmcache_config: Any, engine: Any) -> str | None:
    """Why LMCache's remote store could read only whole chunks, or None. A remote connector that does not save
    each object's metadata (``save_chunk_meta: false``, or one that never does) sizes every read as a whole
    chunk, so a part would come back as the wrong size and every load would fail."""
    extra = getattr(lmcache_config, "extra_config", None) or {}
    if getattr(lmcache_config, "remote_url", None) and extra.get("save_chunk_meta", True) is False:
        return "LMCache's extra_config sets save_chunk_meta: false for the remote store"
    backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", {})
    for name, backend in backends.items():
        connection = getattr(backend, "connection", None)
        if connection is not None and getattr(connection, "save_chunk_meta", True) is False:
            return f"LMCache's {name} ({type(connection).__name__}) stores no per-object metadata"
    return None


def _settings(lmcache_config: LMCacheEngineConfig, vllm_config: VllmConfig) -> PlatformSettings:
    """Our keys as the GPU connector reads them: vLLM's ``kv_connector_extra_config`` over the environment over
    LMCache's ``extra_config``."""
    return connector_settings(lmcache_config, getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config",
                                                      None))


def _reports_failed_loads() -> bool:
    """Whether this vLLM takes per-request load failures (``KVConnectorTransferResults.failed_recving``)."""
    from vllm.distributed.kv_transfer.kv_connector.v1 import base

    return hasattr(base, "KVConnectorTransferResults")


_policy_warned = False
_contract_logged = False


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


def _is_resumed(cached_reqs: Any, index: int, req_id: str) -> bool:
    if hasattr(cached_reqs, "resumed_req_ids"):
        return req_id in cached_reqs.resumed_req_ids
    if hasattr(cached_reqs, "resumed_from_preemption"):
        return bool(cached_reqs.resumed_from_preemption[index])
    raise AttributeError(f"cannot tell whether request {req_id} resumed from preemption with this vLLM")


class MultiGroupConnectorImpl(LMCacheConnectorV1Impl):
    """``LMCacheConnectorV1Impl`` for hybrid models; works for one group exactly like upstream's."""

    # Set by upstream's __init__; typed here since LMCache ships no type information.
    kv_caches: dict[str, Any]
    layerwise_retrievers: list[Any]

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, parent: Any) -> None:
        """``parent`` is the vLLM connector wrapping this impl: ours, or any wrapper of upstream's impl name
        (``wrapper_contract``); the engine it builds gets our GPU connector."""
        with layout_engine():
            super().__init__(vllm_config, role, parent)
        self.role_name = role.name.lower()
        self._shut_down = False
        health.record(self.role_name, "init", self._manager)
        if self.config.use_layerwise:
            raise ValueError("LMCache layerwise mode (use_layerwise) is not supported by the lmcache_platforms "
                             "vLLM integration yet: its per-layer calls carry no per-group block ids")
        logger.info("LMCache platforms engine impl (%s): %s; %s", self.role_name, self.plan.describe(),
                    self.model.describe())
        if not self.model.weights_found:
            logger.warning("the weight files of %s were not found: chunk keys tell its weights apart only by "
                           "model name and revision; set platforms.model_revision to name them",
                           vllm_config.model_config.model)
        self._log_contract()
        if not self.hits_allowed:
            logger.warning("LMCache will neither save nor report hits for this model: %s", self.why_no_hits())
        if role == KVConnectorRole.SCHEDULER:
            warn_about_failure_policy(vllm_config, self.hits_allowed)
        # Only a built impl: a refused one's LMCache services are left as upstream leaves them (shutting one down
        # at exit hung the process that had refused it).
        shut_down_at_exit(self)

    @property
    def hits_allowed(self) -> bool:
        """The plan allows hits and the wrapper can carry them."""
        return self.plan.hits_allowed and self.contract.refuses(self.plan.multi_group) is None

    def why_no_hits(self) -> str:
        return self.contract.refuses(self.plan.multi_group) or self.plan.why_no_hits()

    def _log_contract(self) -> None:
        """Once per process: what an upstream wrapper cannot carry, and the connector that can."""
        global _contract_logged
        line = self.contract.switched_off(self.settings.load_mode)
        if line is not None and not _contract_logged:
            _contract_logged = True
            logger.warning("%s", line)

    def _init_connector_state(self, role: KVConnectorRole, vllm_config: VllmConfig,
                              config: LMCacheEngineConfig) -> None:
        super()._init_connector_state(role, vllm_config, config)
        self.settings = _settings(config, vllm_config)
        self.model = model_identity(vllm_config.model_config, self.settings.model_revision)
        kv_cache_config = getattr(self._parent, "_kv_cache_config", None)
        if kv_cache_config is None:
            self.plan: GroupPlan = single_group_plan(self._block_size)
            self._num_blocks: int | None = None
        else:
            self.plan = plan_groups(kv_cache_config.kv_cache_groups, self.settings,
                                    StepSettings.from_vllm(vllm_config, config.chunk_size))
            self._num_blocks = kv_cache_config.num_blocks
        self.layout: KVLayout | None = None
        self._key_tags: dict[str, str] = {}
        # vLLM 0.33 sleep mode: the KV caches may be unmapped while this is set (see unregister_kv_caches).
        self._kv_unregistered = False
        self._skips_logged = False
        self._kv_signatures: dict[str, Signature] = {}
        # Loads in vLLM's wait state: needs a wrapper that carries them and vLLM's per-request failure report
        # (0.32+; 0.23 has none).
        self.contract = contract_of(self._parent)
        self.waits_for_loads = self.contract.loads_wait and _reports_failed_loads() and (
            self.settings.load_mode == "async" or self.plan.multi_group)
        # Scheduler side: wait-state loads to send with this step's metadata, what each loaded, which failed.
        self._wait_loads: dict[str, RequestMeta] = {}
        self._loaded_while_waiting: dict[str, int] = {}
        self._failed_loads: set[str] = set()
        # Each request's chunk configs as of its latest lookup, and the scope's generation (request_scope.py).
        self._configs: dict[str, dict[str, Any]] = {}
        self._generation = ""
        # Worker side.
        self.loads = AsyncLoads(timeout_s=self.settings.load_timeout_s)
        # What vLLM's stats line and /metrics show (taken by the connector every step).
        self.stats = StatsRecorder()

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the caches (raising on a layout we cannot read), hand them to the GPU connector, then let
        LMCache finish initialising (upstream's post_init)."""
        if self.kv_caches:
            raise RuntimeError("register_kv_caches called twice")
        if not kv_caches:
            raise ValueError("register_kv_caches got no KV caches")
        if self.plan.saved and self.lmcache_engine is not None:  # degraded mode moves nothing
            self._attach_layout(kv_caches)
        self.kv_caches = kv_caches
        self._kv_signatures = {name: kv_signature(value) for name, value in kv_caches.items()}
        self._manager.post_init()
        health.record(self.role_name, "post_init", self._manager)

    def _attach_layout(self, kv_caches: dict[str, Any]) -> None:
        """Bind the caches' layout to our GPU connector; its key tags and the model's identity then go into
        every store, load and lookup. Upstream's connector is refused: it needs the KV tensors and per-token
        slots in every call, which our metadata does not carry (the catalog installs our connector factory with
        this impl)."""
        engine = self.lmcache_engine
        connector = engine.gpu_connector
        if not isinstance(connector, LayoutConnector):
            raise RuntimeError(f"LMCache's GPU connector is {type(connector).__name__}, not lmcache_platforms' "
                               f"({self.plan.describe()}). Is lmcache_platforms activated in this process?")
        self.layout = build_layout(kv_caches, self.plan, self._lmcache_chunk_size, self.settings,
                                   vllm_hint_for(self._vllm_config), self._num_blocks)
        binding = _bind(connector, self.layout, self._split_chunks())
        if connector.parts:
            install_parts(engine, connector.parts, self._lmcache_chunk_size)
        self._key_tags = {**binding.key_tags, **cache_dtype_tags(self._vllm_config), MODEL_TAG: self.model.tag}
        tag_engine_lookups(engine, self._key_tags)

    def _split_chunks(self) -> bool:
        """Chunk parts (``connector.parts``) unless the setting says whole, LMCache's async loading is on (its
        prefetching lookup knows one key per chunk), or a remote store reads chunks whole (logged)."""
        if self.settings.chunk_parts != "window" or self.async_loading:
            return False
        reason = whole_chunk_reader(self.config, self.lmcache_engine)
        if reason is not None:
            logger.info("platforms.chunk_parts=window but %s: chunks are stored whole", reason)
        return reason is None

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """Per-step state is reset here: vLLM 0.32+ calls start_load_kv only on steps with synchronous loads."""
        self.current_layer = 0
        self.layerwise_retrievers = []

    def _transfer_kwargs(self, meta: RequestMeta, block_ids: Any) -> dict[str, Any]:
        """What our GPU connector reads (see ``lmcache_platforms.connector.request``), plus the key tags."""
        return {"block_ids": block_ids, "request_configs": with_tags(meta.request_configs, self._key_tags),
                "req_id": meta.req_id}

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
            elif request.load_while_waiting:
                self.loads.submit(request.req_id, partial(self._load_waiting, engine, request),
                                  wait=self.settings.load_mode == "sync")
            else:
                first = self.loads.call(request.req_id, partial(self._load_one, engine, request),
                                        on_failure=spec.vllm_cached_tokens)
                if first is not None:
                    self._fail_load(request, first, spec.lmcache_cached_tokens)

    def _skip_load(self, engine: LMCacheEngine, request: RequestMeta) -> None:
        """A load while the KV caches are unregistered (vLLM stepped before restore_kv_caches): nothing is
        copied into memory that may be unmapped, and the load is reported failed (per request, or per block for
        a single-group model's same-step load), so vLLM recomputes rather than decode from rows never loaded."""
        spec = request.load_spec
        assert spec is not None
        if not self.async_loading:
            engine.lookup_unpin(request.req_id)
        logger.error("request %s: not loading tokens [%d, %d): the KV caches are unregistered (vLLM sleep mode) "
                     "and restore_kv_caches was not called", request.req_id, spec.vllm_cached_tokens,
                     spec.lmcache_cached_tokens)
        if request.load_while_waiting:
            self.loads.fail(request.req_id)
        else:
            self._fail_load(request, spec.vllm_cached_tokens, spec.lmcache_cached_tokens)

    def _load_waiting(self, engine: LMCacheEngine, request: RequestMeta, _req_id: str, guard: LoadGuard) -> bool:
        """A load while its request waits (``AsyncLoads.submit``): whether every token arrived intact."""
        return self._load_one(engine, request, guard) is None

    def _load_one(self, engine: LMCacheEngine, request: RequestMeta, guard: LoadGuard) -> int | None:
        """Retrieve one request's hit into its blocks; the first token that did not arrive intact, or None.
        Runs on the loader thread; never raises for a load that came back short."""
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
        binding = self._binding()
        bytes_before = binding.counters.bytes_loaded if binding is not None else 0
        chunks_before = binding.counters.chunks_loaded if binding is not None else 0
        started = time.perf_counter()
        try:
            ret_mask = engine.retrieve(
                request.token_ids[:num_tokens],
                mask,
                vllm_cached_tokens=spec.vllm_cached_tokens,
                load_guard=guard,
                **self._transfer_kwargs(request, request.blocks_not_held(spec.vllm_cached_tokens, num_tokens)),
            )
        finally:
            if not self.async_loading:
                engine.lookup_unpin(request.req_id)
            self.stats.timing("load_seconds", time.perf_counter() - started)
            if binding is not None:
                self.stats.count("bytes_loaded", binding.counters.bytes_loaded - bytes_before)
                self.stats.count("chunks_loaded", binding.counters.chunks_loaded - chunks_before)
        if guard.failure is not None:
            logger.error("request %s: LMCache load of %d tokens failed: %s", request.req_id, int(mask.sum()),
                         guard.failure)
            return skipped
        missing = mask & ~ret_mask.to(device="cpu", dtype=torch.bool)
        if not bool(missing.any()):
            if binding is not None:
                logger.info("request %s: loaded tokens [%d, %d) from LMCache, %d bytes read", request.req_id,
                            skipped, num_tokens, binding.counters.bytes_loaded - bytes_before)
            return None
        first = int(torch.nonzero(missing)[0])
        logger.error("request %s: LMCache returned %d of %d expected tokens; failed from token %d",
                     request.req_id, int((mask & ret_mask.cpu().bool()).sum()), int(mask.sum()), first)
        return first

    def _fail_load(self, request: RequestMeta, first: int, num_tokens: int) -> None:
        """A single-group model's synchronous load did not fully arrive: its blocks holding tokens
        ``[first, num_tokens)`` go to vLLM, which recomputes or fails the request."""
        self.stats.count("loads_failed")
        if self.plan.multi_group:
            raise RuntimeError(
                f"request {request.req_id}: a load of a model with {len(self.plan.saved)} KV-cache groups ran in "
                "the step that computes it, where vLLM cannot be told it failed (this vLLM has no "
                f"failed_recving); tokens [{first}, {num_tokens}) never arrived")
        self._invalid_block_ids.update(request.failed_blocks(first, num_tokens))

    def get_transfer_results(self) -> LoadResults:
        """Wait-state loads that ended since the last step (failed ones are also in ``finished``)."""
        results = self.loads.poll()
        self.stats.count("loads_failed", len(results.failed))
        return results

    def wait_for_save(self) -> None:
        engine = self.lmcache_engine
        if engine is None:
            return
        metadata = self._parent._get_connector_metadata()
        for request in metadata.requests:
            if request.load_while_waiting:
                continue  # its load (maybe still running) releases its pins; it saves once scheduled
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
            binding = self._binding()
            bytes_before = binding.counters.bytes_stored if binding is not None else 0
            chunks_before = binding.counters.chunks_stored if binding is not None else 0
            started = time.perf_counter()
            engine.store(
                request.token_ids[:end],
                mask=mask,
                offset=start,
                **self._transfer_kwargs(request, request.block_ids),
            )
            if binding is None:
                continue
            self.stats.timing("store_seconds", time.perf_counter() - started)
            self.stats.count("bytes_stored", binding.counters.bytes_stored - bytes_before)
            self.stats.count("chunks_stored", binding.counters.chunks_stored - chunks_before)
            if binding.counters.bytes_stored > bytes_before:
                logger.info("request %s: stored tokens [%d, %d) in LMCache, %d bytes written", request.req_id,
                            start, end, binding.counters.bytes_stored - bytes_before)

    def _log_skipped_save(self, req_id: str) -> None:
        """A skipped save costs a future cache miss only, so it is logged (once per sleep), not raised."""
        if self._skips_logged:
            logger.debug("request %s: not saved, the KV caches are unregistered", req_id)
            return
        self._skips_logged = True
        logger.warning("request %s: not saving to LMCache: the KV caches are unregistered (vLLM sleep mode) and "
                       "restore_kv_caches was not called; saves are skipped until it is", req_id)

    # ------------------------------------------------------------------ vLLM 0.33 sleep mode

    def _binding(self) -> LayoutBinding | None:
        """Our GPU connector's binding (None in degraded mode, with upstream's connector, or before binding)."""
        connector = getattr(self.lmcache_engine, "gpu_connector", None)
        return connector.binding if isinstance(connector, LayoutConnector) else None

    def unregister_kv_caches(self) -> None:
        """Before sleep mode unmaps the KV memory: from here on no store or load touches the KV tensors (saves
        are skipped, loads reported failed, and the binding refuses transfers from LMCache's own threads).
        vLLM has drained its transfers; ours are synchronous, and the binding waits for its streams anyway.
        References to the tensors are kept: vLLM keeps them too, and restore needs them. Idempotent."""
        if self._kv_unregistered:
            return
        self._kv_unregistered = True
        self._skips_logged = False
        binding = self._binding()
        if binding is not None:
            binding.release("unregistered for vLLM sleep mode")
        if self.kv_caches:
            logger.info("KV caches unregistered (vLLM sleep mode): LMCache stores and loads are off until "
                        "restore_kv_caches")

    def restore_kv_caches(self) -> None:
        """After wake-up: transfers resume once every registered KV tensor is where it was bound (the cumem
        allocator maps the same virtual addresses again; the contents are gone, which costs nothing here since
        LMCache's chunks live outside them). A tensor that moved is rebound if the chunk format stays the
        same, else KVCacheMovedError names it and transfers stay off. Idempotent."""
        if not self._kv_unregistered:
            return
        moved = moved_layers(self._kv_signatures, self.kv_caches)
        if moved:
            self._rebind(moved)
        binding = self._binding()
        if binding is not None:
            binding.reacquire()
        self._kv_unregistered = False
        if self.kv_caches:
            logger.info("KV caches restored after vLLM sleep mode: LMCache stores and loads are back on")

    def _rebind(self, moved: dict[str, str]) -> None:
        """Bind the layout of the tensors vLLM now holds, or refuse. ``self.kv_caches`` is the dict vLLM
        registered, whose tensor objects its attention layers use: a backend that moves the memory keeps those
        objects and repoints them (``set_``), or replaces the dict's entries."""
        listed = "; ".join(f"layer {name!r}: {how}" for name, how in list(moved.items())[:4])
        engine = self.lmcache_engine
        connector = getattr(engine, "gpu_connector", None)
        if self.layout is None or not isinstance(connector, LayoutConnector):
            self._kv_signatures = {name: kv_signature(value) for name, value in self.kv_caches.items()}
            return  # nothing bound (degraded mode or nothing saved): nothing to rebind
        old_binding = connector.binding
        assert old_binding is not None  # self.layout is set only once the connector is bound
        try:
            layout = build_layout(self.kv_caches, self.plan, self._lmcache_chunk_size, self.settings,
                                  vllm_hint_for(self._vllm_config), self._num_blocks)
        except (ValueError, RuntimeError) as exc:  # LayoutError, TransferError, UnknownCacheLayout
            raise KVCacheMovedError(f"KV caches moved during vLLM sleep mode ({listed}) and their layout cannot "
                                    f"be described: {exc}; transfers stay off") from exc
        fmt = paged_format(layout)
        now = [paged_format(layout, part.transfer_groups) for part in connector.parts] or [fmt]
        was = old_binding.formats
        if [(f.fingerprint, f.shape, f.dtype) for f in now] != [(f.fingerprint, f.shape, f.dtype) for f in was]:
            raise KVCacheMovedError(
                f"KV caches moved during vLLM sleep mode ({listed}) and their chunk format changed (key tag "
                f"{old_binding.fingerprint} -> {layout_fingerprint(now)}, {sum(f.nbytes for f in was)} -> "
                f"{sum(f.nbytes for f in now)} bytes per chunk): LMCache's chunk shape and keys were fixed when "
                "the caches were registered; transfers stay off")
        binding = _bind(connector, layout, bool(connector.parts))
        binding.counters = old_binding.counters
        self.layout = layout
        self._kv_signatures = {name: kv_signature(value) for name, value in self.kv_caches.items()}
        logger.warning("KV caches moved during vLLM sleep mode (%s); rebound the same chunk format (key tag %s)",
                       listed, binding.fingerprint)

    def shutdown(self) -> None:
        """Chunk writes still in flight to LMCache's slower tiers finish first (bounded), so a server stopped
        right after a request keeps that request's chunks for the next one; then upstream's shutdown. Idempotent:
        vLLM's engine shutdown and the exit hook (``exit_shutdown``) may both call it."""
        if self._shut_down:
            return
        self._shut_down = True
        self.loads.shutdown()
        if self.lmcache_engine is not None:
            drain_writes(self.lmcache_engine, timeout_s=self.settings.drain_timeout_s)
        super().shutdown()

    # ------------------------------------------------------------------ scheduler side

    @property
    def lookup_client(self) -> Any:
        """Upstream's lookup client, its lookups scoped to the request being looked up (``request_scope``)."""
        client = super().lookup_client
        return None if client is None else ScopedLookups(client)

    def _request_configs(self, request: Request) -> dict[str, Any]:
        """What keys this request's chunks besides its tokens (its LMCache request configs and its scope), as
        of its latest lookup: a load must use the generation its hit was found in."""
        configs = self._configs.get(request.request_id)
        if configs is None:
            configs = scoped_configs(request, extract_request_configs(request.sampling_params), self._generation)
        return configs

    def reset_cache(self) -> bool:
        """vLLM reset its prefix cache and asked us too: KV computed before never hits again. Nothing is deleted
        (the store may be shared, and LMCache's tiers cannot be cleared at once): every later lookup uses a new
        generation of scopes instead. A request keeps the generation of its latest lookup: one running now stores
        its KV, computed before, in the old one; one preempted is looked up again."""
        self._generation = secrets.token_hex(8)
        logger.info("vLLM reset its prefix cache: LMCache's chunks stored before are no longer looked up "
                    "(scope generation %s)", self._generation)
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int | None:
        """Upstream's contract (every upstream wrapper calls this): LMCache's hit beyond vLLM's own, a count. A
        request whose load failed once is recomputed: a second lookup would find the same broken chunk."""
        self._configs[request.request_id] = scoped_configs(
            request, extract_request_configs(request.sampling_params), self._generation)
        if not self.hits_allowed or request.request_id in self._failed_loads:
            return 0
        with looking_up(self._request_configs(request)):
            tokens = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if tokens and self.plan.snapshot_groups:
            tokens = self._to_snapshot(request.request_id, num_computed_tokens, tokens)
        return tokens

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
        """Scheduler side: remember failed wait-state loads, so the request is recomputed and saved anew."""
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            self._failed_loads.add(req_id)
            self._loaded_while_waiting[req_id] = 0

    def _loaded_tokens(self, req_id: str, load_spec: LoadSpec | None) -> int:
        """Tokens LMCache holds for a request scheduled now: this step's load, or one done while it waited."""
        waited = self._loaded_while_waiting.pop(req_id, 0)
        return load_spec.lmcache_cached_tokens if load_spec is not None else waited

    def _to_snapshot(self, req_id: str, num_computed_tokens: int, need: int) -> int:
        """A hit must end where a snapshot exists, a chunk boundary: upstream's full-prompt hit (one token short,
        so vLLM computes the last) goes back to the previous boundary."""
        chunk = self._lmcache_chunk_size
        end = (num_computed_tokens + need) // chunk * chunk
        spec = self.load_specs.get(req_id)
        if spec is not None:
            spec.lmcache_cached_tokens = min(spec.lmcache_cached_tokens, end)
        return max(0, end - num_computed_tokens)

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
        if _is_resumed(cached, index, req_id):
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

