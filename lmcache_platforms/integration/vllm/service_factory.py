"""The LMCache service factory our engine impl builds its services with: LMCache's vLLM one, except that the
worker's engine is created with our GPU connector (over a KVLayout, paged or layerwise: ``connector.factory``).

Upstream's factory asks ``CreateGPUConnector`` for a vLLM engine's connector and then creates the engine; ours
creates that engine first, with our connector, under the same name, and upstream's then finds it. Every other
caller of ``CreateGPUConnector`` (SGLang, TensorRT-LLM, an upstream vLLM impl left in place) is untouched.
"""

from __future__ import annotations

from typing import Any

from lmcache.integration.vllm.utils import ENGINE_NAME
from lmcache.integration.vllm.vllm_service_factory import VllmServiceFactory
from lmcache.v1.cache_engine import LMCacheEngine, LMCacheEngineBuilder

from lmcache_platforms.connector.factory import layout_connector


class LayoutServiceFactory(VllmServiceFactory):
    """LMCache's vLLM service factory whose worker engine moves chunks through our layout connector."""

    def get_or_create_lmcache_engine(self) -> LMCacheEngine | None:
        if self.role != "scheduler" and LMCacheEngineBuilder.get(ENGINE_NAME) is None:
            from vllm.distributed.parallel_state import get_tp_group

            metadata = self.get_or_create_metadata()
            group: Any = get_tp_group()
            LMCacheEngineBuilder.get_or_create(ENGINE_NAME, self.lmcache_config, metadata,
                                               layout_connector(self.lmcache_config, metadata), group.broadcast,
                                               group.broadcast_object)
        return super().get_or_create_lmcache_engine()
