"""``LMCachePlatformsConnector``: LMCache's in-process connector for vLLM, declaring hybrid-KV (HMA) support.

Upstream's connector is not ``SupportsHMA``, so vLLM either turns the hybrid KV-cache manager off (sliding
window layers then cost full attention memory, Mamba / DeepSeek-V4 cannot start) or refuses to start with
``--no-disable-hybrid-kv-cache-manager``. This one can say yes because its engine impl tracks, saves and
loads every group. It is a thin delegate: all the work is in ``MultiGroupConnectorImpl``.
Use: ``--kv-transfer-config '{"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"}'``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)

from lmcache_platforms.integration.vllm.readiness import ensure_ready
from lmcache_platforms.integration.vllm.stats import PlatformsConnectorStats, PlatformsPromMetrics

if TYPE_CHECKING:
    from collections.abc import Iterable

    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_events import KVCacheEvent, KVConnectorKVEvents
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from lmcache_platforms.integration.vllm.engine_impl import MultiGroupConnectorImpl


def _impl_class() -> type[MultiGroupConnectorImpl]:
    """Imported only when a connector is built: vLLM imports this module while it validates its config,
    before its CPU worker starts, and importing LMCache that early crashed that worker. Upstream's adapter
    goes first: importing it fires our patch of its LMCacheConnectorV1Impl, which imports engine_impl;
    were engine_impl the importer, the patch would find engine_impl half-initialised."""
    importlib.import_module("lmcache.integration.vllm.vllm_v1_adapter")
    return importlib.import_module("lmcache_platforms.integration.vllm.engine_impl").MultiGroupConnectorImpl


class LMCachePlatformsConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector (both roles) backed by an in-process LMCache engine, for any number of groups."""

    CARRIES_WAITING_LOADS = True
    """Its impl's hits may load while their request waits (``wrapper_contract``): ``match`` and ``after_alloc``."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        # None where vLLM builds the connector without one (the scheduler-side probe of older releases).
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type]
        impl_class = _impl_class()
        ensure_ready()
        self._impl = impl_class(vllm_config, role, self)

    @property
    def impl(self) -> MultiGroupConnectorImpl:
        return self._impl

    # Worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._impl.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._impl.bind_connector_metadata(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._impl.start_load_kv(forward_context, **kwargs)

    def wait_for_layer_load(self, layer_name: str) -> None:
        self._impl.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """``kv_layer`` may be a tensor or (vLLM 0.23 MLA/DSA layers) a list of them; passed on untouched."""
        self._impl.save_kv_layer(layer_name, kv_layer, attn_metadata, **kwargs)

    def wait_for_save(self) -> None:
        self._impl.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """vLLM before 0.32 (no ``get_transfer_results``): loads that waited and ended, failures not told apart
        (on such a vLLM loads never wait, see ``MultiGroupConnectorImpl.waits_for_loads``)."""
        results = self._impl.get_transfer_results(finished_req_ids)
        return None, results.finished or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ran while their request waited and ended since the last step; failed ones are in both
        ``finished_recving`` and ``failed_recving``, so vLLM recomputes or fails that request alone."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

        results = self._impl.get_transfer_results(finished_req_ids)
        return KVConnectorTransferResults(finished_recving=results.finished, failed_recving=results.failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._impl.get_block_ids_with_load_errors()

    # vLLM 0.33 sleep mode (0.32 and 0.23 never call these; they are plain extra methods there)
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: KVTransferConfig) -> bool:
        """True, checked rather than inherited (vLLM's default is True for every connector): the KV tensors are
        the only device memory of ours that sleep mode takes away (LMCache's engine, our scratch buffers and
        kernel tables are allocated outside vLLM's cumem pools, its chunks live in host memory, disk or remote
        storage); between unregister and restore no transfer touches those tensors; restore checks they are
        back at the bound addresses and rebinds or refuses when not. LMCache's chunks survive sleep, but vLLM
        (0.32's engine core) pauses a sleep of level >= 1 with ``clear_cache``, which calls ``reset_cache``: what
        was stored before is then never looked up again (the weights may be replaced meanwhile). Decided from
        the class alone (vLLM asks while validating its config, before any connector exists), so
        ``kv_transfer_config`` is not read."""
        return True

    def unregister_kv_caches(self) -> None:
        """Before sleep mode unmaps the KV memory: stores and loads stop touching it. Idempotent."""
        self._impl.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """After wake-up: transfers resume once the KV tensors are checked (or rebound). Idempotent."""
        self._impl.restore_kv_caches()

    def shutdown(self) -> None:
        """Idempotent (the impl's is): vLLM's engine shutdown and the impl's exit hook may both run it."""
        self._impl.shutdown()

    # Both sides: statistics (vLLM's stats line, /metrics)
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._impl.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PlatformsConnectorStats(data)

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PlatformsPromMetrics:
        return PlatformsPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # Both sides: KV events for routers (vLLM's --kv-events-config publisher)
    def get_kv_connector_kv_cache_events(self) -> KVConnectorKVEvents | None:
        """Worker side: what this worker's stores made hits since the last step (``kv_events``)."""
        return self._impl.take_stored_prefixes()

    def take_events(self) -> Iterable[KVCacheEvent]:
        """Scheduler side: ``BlockStored`` for what every worker stored, ``AllBlocksCleared`` after a reset."""
        return self._impl.kv_events.take()

    # Scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._impl.match(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self._impl.after_alloc(request, blocks, num_external_tokens)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._impl.update_connector_output(connector_output)

    def reset_cache(self) -> bool:
        return self._impl.reset_cache()

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._impl.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished(request, block_ids)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._impl.request_finished_all_groups(request, block_ids)


LMCacheAscendConnector = LMCachePlatformsConnector
"""The name vllm-ascend users already configure; same class (``kv_connector_module_path`` looks names up)."""
