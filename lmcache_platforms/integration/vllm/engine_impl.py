"""The in-process LMCache engine impl for vLLM, for every KV-cache group (replaces ``LMCacheConnectorV1Impl``).

It builds upstream's engine life cycle itself, from LMCache's public pieces (config, ``LMCacheManager``, lookup
client/server, abort clean-up), with a service factory that gives the worker's engine our GPU connector
(``service_factory``), and replaces what assumed one group: the request tracker, the per-step metadata,
loading, saving and failed-block reporting. Rules on top of upstream's:
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
  - LMCache's own asynchronous loading (``enable_async_loading``: its prefetching lookup and its retrieve know one
    object per chunk, none of our parts or recurrent states), CacheBlend (``enable_blending``) and remote serdes
    other than ``naive`` are refused before any service starts;
  - degraded mode (engine init failed) is logged as an error and reported by ``health.engine_health``;
  - every chunk key carries the request's scope (LoRA adapter, cache_salt, the generation a prefix-cache reset
    bumps: ``request_scope``) and the model's identity (``model_identity``), besides the layout fingerprint;
  - LMCache's ``use_layerwise`` is taken over: the engine stays paged (same chunk objects, hits across modes)
    and the worker side stores each layer as the forward writes it and loads a same-step hit layer by layer
    ahead of the forward (``worker_side``, ``worker_loads``, ``connector.layer_gate``);
  - vLLM 0.33 sleep mode: between ``unregister_kv_caches`` and ``restore_kv_caches`` nothing of ours touches
    the KV tensors (a save is skipped, a load reported failed), and restore checks they did not move.

The work is split by the side that runs it, combined here: ``scheduler_side.py``, ``worker_side.py`` (its
saves, over ``worker_loads.py``) and ``lifecycle.py`` (registering the caches, sleep mode, reset, shutdown),
over the state they share (``impl_state.py``). Catalog and activation replace upstream's impl by this module's
class, by name.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

from lmcache.banner import print_banner_once
from lmcache.integration.vllm.utils import lmcache_get_or_create_config
from lmcache.v1.manager import LMCacheManager
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_platforms.integration.vllm import health
from lmcache_platforms.integration.vllm.exit_shutdown import shut_down_at_exit
from lmcache_platforms.integration.vllm.lifecycle import Lifecycle
from lmcache_platforms.integration.vllm.scheduler_side import SchedulerSide, warn_about_failure_policy
from lmcache_platforms.integration.vllm.service_factory import LayoutServiceFactory
from lmcache_platforms.integration.vllm.worker_side import WorkerSide
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = init_logger(__name__)

_contract_logged = False


UNSUPPORTED_LMCACHE_MODES = {
    "enable_async_loading": "LMCache's prefetching lookup and load know one object per chunk, none of its parts or "
                            "recurrent states): set enable_async_loading to false; platforms.load_mode=async loads "
                            "a hit while its request waits, other requests running meanwhile",
    "enable_blending": "CacheBlend keys and loads token segments, not the chunks our layouts move): set "
                       "enable_blending to false",
}
"""LMCache modes our connector refuses, each with why and what to set (under the fuzzer, async loading failed
concurrent hits of one prefix and recurrent models answered nothing; blending left the worker degraded)."""


def refuse_unsupported_lmcache_modes(config: Any) -> None:
    """Refuse, before any service starts, an LMCache mode our connector cannot serve (``UNSUPPORTED_LMCACHE_MODES``,
    and a remote serde other than ``naive``): otherwise the scheduler accepts it and the worker's engine fails
    later, or serves wrongly (``remote_serde: cachegen`` ended the engine at its first store: LMCache's codecs
    reshape an object as its own KV layout)."""
    for key, why in UNSUPPORTED_LMCACHE_MODES.items():
        if getattr(config, key, False):
            raise ValueError(f"LMCache's {key} is not supported by lmcache_platforms' connector ({why}")
    serde = getattr(config, "remote_serde", None)
    if serde not in (None, "naive"):
        raise ValueError(f"LMCache's remote_serde {serde!r} is not supported by lmcache_platforms' connector (its "
                         "codec re-encodes an object as LMCache's own KV layout; ours are chunk objects with their "
                         "own layout and checksum): set remote_serde to naive")


class MultiGroupConnectorImpl(Lifecycle, SchedulerSide, WorkerSide):
    """``LMCacheConnectorV1Impl`` for hybrid models; works for one group exactly like upstream's."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, parent: Any) -> None:
        """``parent`` is the vLLM connector wrapping this impl: ours, or any wrapper of upstream's impl name
        (``wrapper_contract``); the engine it builds gets our GPU connector."""
        self._build(vllm_config, role, parent)
        self.role_name = role.name.lower()
        health.record(self.role_name, "init", self._manager)
        logger.info("LMCache platforms engine impl (%s): %s; %s%s", self.role_name, self.plan.describe(),
                    self.model.describe(), "; layerwise: stores follow the forward and same-step loads run ahead "
                    "of it, layer by layer, over the paged chunk objects" if self.layerwise else "")
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

    def _build(self, vllm_config: VllmConfig, role: KVConnectorRole, parent: Any) -> None:
        """LMCache's services, built as upstream's impl builds them (its config with vLLM's ``lmcache.*`` keys,
        a manager starting the services, the connector state, the metrics of its structures), from LMCache's
        public pieces, with our service factory: the worker's engine gets our GPU connector."""
        transfer = vllm_config.kv_transfer_config
        if transfer is None:
            raise ValueError("LMCache's engine impl is built only for a KV connector: vLLM has no kv_transfer_config")
        if role == KVConnectorRole.SCHEDULER:
            print_banner_once(sys.stderr)
        self._parent = parent
        self._vllm_config = vllm_config
        self._role = role
        self.device = vllm_config.device_config.device
        self.kv_role = transfer.kv_role
        self.worker_count = vllm_config.parallel_config.tensor_parallel_size
        self.config = lmcache_get_or_create_config()
        self._apply_extra_config(self.config, vllm_config)
        refuse_unsupported_lmcache_modes(self.config)
        factory = LayoutServiceFactory(self.config, vllm_config, role.name.lower())
        self._manager = LMCacheManager(self.config, factory, connector=self)
        self._manager.start_services()
        self._init_connector_state(role, vllm_config, self.config)
        self._setup_metrics()

    def _log_contract(self) -> None:
        """Once per process: what an upstream wrapper cannot carry, and the connector that can."""
        global _contract_logged
        line = self.contract.switched_off(self.settings.load_mode)
        if line is not None and not _contract_logged:
            _contract_logged = True
            logger.warning("%s", line)

