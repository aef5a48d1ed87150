"""Our replacement for upstream's ``lmcache.v1.gpu_connector.CreateGPUConnector`` (same signature).

vLLM engines get a connector over a KVLayout (layerwise when ``config.use_layerwise``); it exists as soon as
the engine does and is bound to the layout when vLLM registers its KV caches:
``engine.gpu_connector.bind(layout)`` must run before ``engine.post_init()`` and the first store. Every other
engine type (SGLang, TRT-LLM, mock) goes to upstream's factory unchanged. The kernel backend comes from our
settings (``extra_config`` key ``platforms.kernel_backend`` or ``LMCACHE_PLATFORMS_KERNEL_BACKEND``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from lmcache_platforms.config import PlatformSettings

UPSTREAM_MODULE = "lmcache.v1.gpu_connector"


def _unpatched_upstream() -> Callable[..., Any] | None:
    module = sys.modules.get(UPSTREAM_MODULE)
    factory = getattr(module, "CreateGPUConnector", None)
    return None if factory is None or factory is create_gpu_connector else factory


def create_gpu_connector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
    """A GPU connector for ``engine``: ours for vLLM, upstream's for the rest."""
    from lmcache.utils import EngineType

    if engine != EngineType.VLLM:
        upstream = _UPSTREAM or _unpatched_upstream()
        if upstream is None:
            raise RuntimeError(f"no upstream CreateGPUConnector recorded for engine {engine}: import "
                               f"{__name__} before {UPSTREAM_MODULE}.CreateGPUConnector is replaced, "
                               "or pass the original to remember_upstream()")
        return upstream(config, metadata, engine, layout_hints)
    if getattr(config, "enable_blending", False):
        raise ValueError("config.enable_blending is not supported by the lmcache_platforms connector")
    settings = PlatformSettings.load(getattr(config, "extra_config", None))
    if getattr(config, "use_layerwise", False):
        from lmcache_platforms.connector.layerwise import LayerwiseLayoutGPUConnector

        return LayerwiseLayoutGPUConnector(metadata, settings.kernel_backend)
    from lmcache_platforms.connector.paged import LayoutGPUConnector

    return LayoutGPUConnector(metadata, settings.kernel_backend)


def remember_upstream(factory: Callable[..., Any]) -> None:
    """Record upstream's factory (for activation code that imported us after the attribute was replaced)."""
    global _UPSTREAM
    if factory is not create_gpu_connector:
        _UPSTREAM = factory


# Captured when the patch registry imports us to resolve the replacement, i.e. before it swaps the attribute.
_UPSTREAM = _unpatched_upstream()
