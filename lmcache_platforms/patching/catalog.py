"""The one list of every upstream symbol lmcache_platforms replaces. Nothing is patched anywhere else."""

from __future__ import annotations

from lmcache_platforms.patching.patch import Patch

LMCACHE = "lmcache==0.5.6"

PATCHES: tuple[Patch, ...] = (
    Patch(
        target="lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl",
        replacement="lmcache_platforms.integration.vllm.engine_impl:MultiGroupConnectorImpl",
        versions=LMCACHE,
        stale_copies=(
            "lmcache.integration.vllm.lmcache_connector_v1",
            "lmcache.integration.vllm.lmcache_connector_v1_085",
        ),
        requires=("vllm",),
        why="upstream's in-process impl tracks KV-cache group 0 only; ours tracks, saves and loads every group "
            "and reports degraded mode (vLLM's LMCacheConnectorV1 looks the name up in this module at init)",
    ),
)
