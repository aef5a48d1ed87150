"""The GPU connector a vLLM engine built by our engine impl gets: over a KVLayout, paged, or layerwise when
``config.use_layerwise``; bound to the layout when vLLM registers its KV caches (``engine.gpu_connector.bind(layout)``
runs before ``engine.post_init()`` and the first store). Our service factory creates the engine with it
(``integration.vllm.service_factory``); every other engine gets upstream's ``CreateGPUConnector``'s, unchanged:
only our impl speaks to our connector (per-group block ids instead of per-token slots). The kernel backend comes
from our settings: ``platforms.kernel_backend`` in vLLM's ``kv_connector_extra_config`` (which LMCache's vLLM
adapter copies into the metadata), else ``LMCACHE_PLATFORMS_KERNEL_BACKEND``, else LMCache's ``extra_config``
(``lmcache_platforms.config``).
"""

from __future__ import annotations

from typing import Any

from lmcache_platforms.config import connector_settings


def layout_connector(config: Any, metadata: Any) -> Any:
    """The connector a vLLM engine gets: paged, or layerwise when the config asks for it (CacheBlend was refused
    when the impl was built: ``engine_impl.refuse_unsupported_lmcache_modes``)."""
    # The metadata is the only place vLLM's kv_connector_extra_config reaches this factory.
    settings = connector_settings(config, getattr(metadata, "kv_connector_extra_config", None))
    if getattr(config, "use_layerwise", False):
        from lmcache_platforms.connector.layerwise import LayerwiseLayoutGPUConnector

        return LayerwiseLayoutGPUConnector(metadata, settings.kernel_backend)
    from lmcache_platforms.connector.paged import LayoutGPUConnector

    return LayoutGPUConnector(metadata, settings.kernel_backend)
