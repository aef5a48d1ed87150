"""vLLM's own HMA decision with our connector vs upstream's (VllmConfig and the connector factory, no model run)."""

from __future__ import annotations

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma

from lmcache_platforms.integration.vllm import registration
from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
from tests.integration.specs import gemma_like
from tests.integration.vllm_env import vllm_config

pytestmark = pytest.mark.slow


def test_vllm_keeps_the_hybrid_manager_on_for_ours_and_turns_it_off_for_upstreams(model_dir):
    assert vllm_config(model_dir, "LMCachePlatformsConnector").scheduler_config.disable_hybrid_kv_cache_manager \
        is False
    assert vllm_config(model_dir, "LMCacheConnectorV1").scheduler_config.disable_hybrid_kv_cache_manager is True


def test_explicit_hybrid_manager_refuses_upstreams_connector_and_accepts_ours(model_dir):
    upstream = vllm_config(model_dir, "LMCacheConnectorV1", disable_hma=False)
    with pytest.raises(ValueError, match="does not support HMA but HMA is enabled"):
        KVConnectorFactory.create_connector(upstream, KVConnectorRole.SCHEDULER, gemma_like())
    ours = vllm_config(model_dir, "LMCachePlatformsConnector", disable_hma=False)
    connector = KVConnectorFactory.create_connector(ours, KVConnectorRole.SCHEDULER, gemma_like())
    try:
        assert isinstance(connector, LMCachePlatformsConnector) and supports_hma(connector)
        assert connector.impl.plan.saved == (0, 1, 2, 3)
    finally:
        connector.shutdown()


def test_registration_is_idempotent_and_module_path_works_too():
    """A second registration leaves vLLM's factory as the first left it: the same entries, the very same loader
    objects (nothing registered again), each loading our class. Negative control: an entry really registered
    again is a new loader, which that comparison sees."""
    registry = KVConnectorFactory._registry
    names = registration.register_connectors()
    first = dict(registry)
    assert registration.register_connectors() == names
    assert registry == first  # loaders are functions: equal only if the very same object
    assert {n: KVConnectorFactory.get_connector_class_by_name(n) for n in names} == \
        dict.fromkeys(names, LMCachePlatformsConnector)
    assert names[0] == "LMCachePlatformsConnector"
    registry.pop("LMCachePlatformsConnector")
    registration.register_connectors()
    assert registry["LMCachePlatformsConnector"] is not first["LMCachePlatformsConnector"]
    from vllm.config import KVTransferConfig

    for name in ("LMCachePlatformsConnector", "LMCacheAscendConnector"):
        config = KVTransferConfig(kv_connector=name, kv_role="kv_both",
                                  kv_connector_module_path=registration.CONNECTOR_MODULE)
        assert KVConnectorFactory.get_connector_class(config) is LMCachePlatformsConnector
