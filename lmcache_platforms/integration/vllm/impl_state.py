"""What the sides of our engine impl share: the group plan, settings, layout, sleep state, loads and statistics.

``MultiGroupConnectorImpl`` (``engine_impl.py``) combines three parts over this base, each in its own module:
``scheduler_side.py`` (lookups, allocation, per-step metadata), ``worker_side.py`` (saves, over the loads of
``worker_loads.py``) and ``lifecycle.py`` (registering the KV caches, sleep mode, reset, shutdown). The
scheduler and worker parts never import each other (import-linter contracts in ``pyproject.toml``); what both
need lives here, set once in ``_init_connector_state``, and each part adds its own state in its own override of
that method.

Import order: this module subclasses upstream's ``LMCacheConnectorV1Impl``, and importing upstream's adapter
fires our patch of that name, which imports ``engine_impl``. Import the adapter first (the connector does).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorV1Impl

from lmcache_platforms.config import PlatformSettings, connector_settings
from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.connector.remote_lookups import remote_lookup_counts
from lmcache_platforms.integration.vllm import vllm_compat
from lmcache_platforms.integration.vllm.async_loads import AsyncLoads
from lmcache_platforms.integration.vllm.cpu_cache_probe import tiled_block_sizes
from lmcache_platforms.integration.vllm.groups import GroupPlan, plan_groups, recurrent_block_sizes, single_group_plan
from lmcache_platforms.integration.vllm.kv_events import EventQueue, tiers_of
from lmcache_platforms.integration.vllm.model_identity import ModelIdentity, model_identity
from lmcache_platforms.integration.vllm.recurrent import chunk_size_for
from lmcache_platforms.integration.vllm.stats import PlatformsConnectorStats, StatsRecorder
from lmcache_platforms.integration.vllm.wrapper_contract import WrapperContract, contract_of
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

logger = init_logger(__name__)

LAYERWISE_TAKEN = "lmcp_layerwise"
"""Where LMCache's config keeps ``use_layerwise`` once an impl took it over (``_apply_extra_config``)."""


def _settings(lmcache_config: LMCacheEngineConfig, vllm_config: VllmConfig) -> PlatformSettings:
    """Our keys as the GPU connector reads them: vLLM's ``kv_connector_extra_config`` over the environment over
    LMCache's ``extra_config``."""
    return connector_settings(lmcache_config, getattr(vllm_config.kv_transfer_config, "kv_connector_extra_config",
                                                      None))


class ImplState(LMCacheConnectorV1Impl):
    """Upstream's impl plus the state every part of ours reads; the parts add methods and their own state."""

    # Set by upstream's __init__; typed here since LMCache ships no type information.
    kv_caches: dict[str, Any]
    layerwise_retrievers: list[Any]

    layerwise: bool
    """LMCache's ``use_layerwise`` as configured: stores follow the forward and in-step loads run ahead of it,
    layer by layer, over the paged chunk objects."""
    settings: PlatformSettings
    model: ModelIdentity
    plan: GroupPlan
    contract: WrapperContract
    waits_for_loads: bool
    loads: AsyncLoads
    stats: StatsRecorder
    kv_events: EventQueue
    """The scheduler side's KV events for vLLM's publisher (``kv_events``); the workers report what they stored."""
    layout: KVLayout | None
    """The layout bound to our GPU connector (None before registering, in degraded mode, or nothing saved)."""
    _num_blocks: int | None
    _key_tags: dict[str, str]
    """What every store, load and lookup adds to LMCache's keys (layout, cache dtype, model identity)."""
    _kv_unregistered: bool
    """vLLM 0.33 sleep mode: the KV caches may be unmapped while this is set (``lifecycle``)."""
    _skips_logged: bool
    _generation: str
    """The scope generation a prefix-cache reset bumps (``request_scope``): set by the lifecycle, read by the
    scheduler side."""

    def _apply_extra_config(self, config: LMCacheEngineConfig, vllm_config: VllmConfig) -> None:
        """Upstream's ``lmcache.*`` keys, then the chunk size recurrent groups need (``recurrent.chunk_size_for``),
        before upstream creates the LMCache engine with it; scheduler and workers choose alike.

        ``use_layerwise`` is taken over here: LMCache's own layerwise mode keys and stores every layer apart
        (and its per-layer calls carry no per-group block ids), so the engine is built paged and our worker side
        moves the paged chunk objects layer by layer instead (``worker_loads``, ``worker_side``): chunks stay hits
        across modes.
        LMCache's config is one object per process (scheduler and worker share it in-process), so the request is
        kept on it under our own name for the impl built second."""
        super()._apply_extra_config(config, vllm_config)
        self.layerwise = bool(config.use_layerwise) or bool(getattr(config, LAYERWISE_TAKEN, False))
        setattr(config, LAYERWISE_TAKEN, self.layerwise)
        config.use_layerwise = False
        kv_cache_config = vllm_compat.kv_cache_config(self._parent)
        if kv_cache_config is None:
            return
        blocks = recurrent_block_sizes(kv_cache_config.kv_cache_groups)
        if blocks:
            chunk_size, line = chunk_size_for(config.chunk_size, blocks)
            (logger.info if chunk_size == config.chunk_size else logger.warning)(line)
            config.chunk_size = chunk_size
        self._cover_tiled_blocks(config, vllm_config, kv_cache_config.kv_cache_groups, blocks)

    @staticmethod
    def _cover_tiled_blocks(config: LMCacheEngineConfig, vllm_config: VllmConfig, groups: Any,
                            recurrent: list[int]) -> None:
        """vLLM's CPU attention in AMX tiles: a block's rows move only as its whole page, so the chunk size is
        rounded up to cover whole blocks (of the recurrent groups too), scheduler and workers alike."""
        if getattr(vllm_config.device_config, "device_type", "") != "cpu":
            return
        model_dtype = getattr(vllm_config.model_config, "dtype", torch.bfloat16)
        cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto"))
        tiled = tiled_block_sizes(groups, model_dtype, cache_dtype, vllm_compat.cpu_attention_isa)
        if not tiled:
            return
        block = math.lcm(*tiled, *recurrent)
        if config.chunk_size % block == 0:
            return
        chunk_size = -(-config.chunk_size // block) * block
        logger.warning("vLLM's CPU attention keeps this KV cache in AMX tiles, which move only as whole %d-token "
                       "blocks: LMCache chunk_size %d is no multiple of them; using chunk_size %d", block,
                       config.chunk_size, chunk_size)
        config.chunk_size = chunk_size

    def _init_connector_state(self, role: KVConnectorRole, vllm_config: VllmConfig,
                              config: LMCacheEngineConfig) -> None:
        super()._init_connector_state(role, vllm_config, config)
        self.settings = _settings(config, vllm_config)
        self.model = model_identity(vllm_config.model_config, self.settings.model_revision)
        kv_cache_config = vllm_compat.kv_cache_config(self._parent)
        if kv_cache_config is None:
            self.plan = single_group_plan(self._block_size)
            self._num_blocks = None
        else:
            self.plan = plan_groups(kv_cache_config.kv_cache_groups, self.settings, config.chunk_size)
            self._num_blocks = kv_cache_config.num_blocks
        self.layout = None
        self._key_tags = {}
        self._kv_unregistered = False
        self._skips_logged = False
        self._generation = ""
        # Loads in vLLM's wait state: needs a wrapper that carries them and vLLM's per-request failure report
        # (0.32+; 0.23 has none).
        self.contract = contract_of(self._parent)
        self.waits_for_loads = self.contract.loads_wait and vllm_compat.reports_failed_loads() and (
            self.settings.load_mode == "async" or self.plan.multi_group)
        self.loads = AsyncLoads(timeout_s=self.settings.load_timeout_s)
        # What vLLM's stats line and /metrics show (taken by the connector every step).
        self.stats = StatsRecorder()
        # Only our connector takes them (upstream wrappers publish LMCache's own events, keyed by its chunk hashes).
        self.kv_events = EventQueue(self.contract.loads_wait and vllm_compat.kv_events_enabled(vllm_config),
                                    vllm_compat.hash_block_size(self._parent, self._block_size), tiers_of(config))

    def take_stats(self) -> PlatformsConnectorStats | None:
        """What vLLM's stats line and /metrics get this step; on a worker (whose lookup server asks the remote
        store) also the remote store's lookup time-outs and skips since the last step."""
        if self.lmcache_engine is not None:
            timed_out, skipped = remote_lookup_counts(self.lmcache_engine)
            self.stats.advance("remote_lookups_timed_out", timed_out)
            self.stats.advance("remote_lookups_skipped", skipped)
        return self.stats.take()

    @property
    def hits_allowed(self) -> bool:
        """The plan allows hits and the wrapper can carry them."""
        return self.plan.hits_allowed and self.contract.refuses(self.plan.multi_group) is None

    def why_no_hits(self) -> str:
        return self.contract.refuses(self.plan.multi_group) or self.plan.why_no_hits()

    def _binding(self) -> LayoutBinding | None:
        """Our GPU connector's binding (None in degraded mode, with upstream's connector, or before binding)."""
        # Asked by every layer of every step: an attribute read and a class check, not an isinstance against the
        # LayoutConnector protocol (which inspects each of its members: half a millisecond a step on 4 layers).
        binding = getattr(getattr(self.lmcache_engine, "gpu_connector", None), "binding", None)
        return binding if isinstance(binding, LayoutBinding) else None
