"""Our replacement for upstream's ``lmcache.v1.gpu_connector.CreateGPUConnector`` (same signature).

Declared in the patch catalog as a wrapper of upstream's factory: a vLLM engine built by our engine impl (inside
``layout_engine()``) gets a connector over a KVLayout (layerwise when ``config.use_layerwise``); every other caller
(SGLang, TRT-LLM, mock engines, and an upstream vLLM adapter left in place, see
``LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER``) goes to upstream's factory unchanged: only our impl speaks to
our connector (per-group block ids instead of per-token slots). The connector exists as soon as the engine does
and is bound to the layout when vLLM registers its KV caches: ``engine.gpu_connector.bind(layout)`` must run
before ``engine.post_init()`` and the first store. The kernel backend comes from our settings:
``platforms.kernel_backend`` in vLLM's ``kv_connector_extra_config`` (which LMCache's vLLM adapter copies into
the metadata), else ``LMCACHE_PLATFORMS_KERNEL_BACKEND``, else LMCache's ``extra_config``
(``lmcache_platforms.config``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

from lmcache_platforms.config import connector_settings

_building_layout_engine: ContextVar[bool] = ContextVar("lmcache_platforms_layout_engine", default=False)


@contextlib.contextmanager
def layout_engine() -> Iterator[None]:
    """While our engine impl builds its LMCache engine (upstream's ``__init__`` calls the factory synchronously),
    the vLLM engine's GPU connector is ours."""
    token = _building_layout_engine.set(True)
    try:
        yield
    finally:
        _building_layout_engine.reset(token)


def layout_connector(config: Any, metadata: Any) -> Any:
    """The connector a vLLM engine gets: paged, or layerwise when the config asks for it."""
    if getattr(config, "enable_blending", False):
        raise ValueError("config.enable_blending is not supported by the lmcache_platforms connector")
    # The metadata is the only place vLLM's kv_connector_extra_config reaches this factory.
    settings = connector_settings(config, getattr(metadata, "kv_connector_extra_config", None))
    if getattr(config, "use_layerwise", False):
        from lmcache_platforms.connector.layerwise import LayerwiseLayoutGPUConnector

        return LayerwiseLayoutGPUConnector(metadata, settings.kernel_backend)
    from lmcache_platforms.connector.paged import LayoutGPUConnector

    return LayoutGPUConnector(metadata, settings.kernel_backend)


def wrap_create_gpu_connector(upstream: Callable[..., Any]) -> Callable[..., Any]:
    """Patch-catalog wrapper: ``upstream`` is the factory being replaced, kept for non-vLLM engines."""

    def create_gpu_connector(config: Any, metadata: Any, engine: Any, layout_hints: Any = None) -> Any:
        """A GPU connector for ``engine``: ours for a vLLM engine our impl builds, upstream's for the rest."""
        from lmcache.utils import EngineType

        if engine != EngineType.VLLM or not _building_layout_engine.get():
            return upstream(config, metadata, engine, layout_hints)
        return layout_connector(config, metadata)

    create_gpu_connector.upstream = upstream  # type: ignore[attr-defined]
    return create_gpu_connector
