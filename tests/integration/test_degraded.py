"""Upstream's silent "degraded mode" (engine init errors swallowed, everything recomputed) is surfaced."""

from __future__ import annotations

import pytest
from lmcache.integration.vllm.vllm_v1_adapter import LMCacheConnectorMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from lmcache_platforms.integration.vllm import health, service_factory
from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
from tests.integration.specs import gemma_like
from tests.integration.vllm_env import vllm_config
from tests.integration.vllm_stack import destroy_distributed, init_distributed, shared_buffer_caches

pytestmark = pytest.mark.slow


def _failing_connector(config, metadata):
    raise RuntimeError("planted: the GPU connector cannot be built")


def test_a_worker_whose_engine_failed_reports_it_and_keeps_vllm_running(model_dir, monkeypatch):
    config = vllm_config(model_dir, "LMCachePlatformsConnector")
    monkeypatch.setattr(service_factory, "layout_connector", _failing_connector)  # the engine's init fails
    kv_cache_config = gemma_like(num_blocks=8)
    health.forget()
    init_distributed(config)
    worker = LMCachePlatformsConnector(config, KVConnectorRole.WORKER, kv_cache_config)
    try:
        (record,) = health.engine_health()
        assert (record["role"], record["stage"], record["degraded"]) == ("worker", "init", True)
        assert "planted: the GPU connector cannot be built" in record["reason"]
        assert health.is_degraded()
        names = [n for g in kv_cache_config.kv_cache_groups for n in g.layer_names]
        worker.register_kv_caches(shared_buffer_caches(8, names))  # no error: vLLM goes on, recomputing
        assert health.engine_health()[0]["stage"] == "post_init" and health.is_degraded()
        worker.bind_connector_metadata(LMCacheConnectorMetadata())
        worker.start_load_kv(None)
        worker.wait_for_save()
        assert worker.get_block_ids_with_load_errors() == set()
    finally:
        worker.shutdown()
        destroy_distributed()
        health.forget()
