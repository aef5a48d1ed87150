"""Every upstream name outside the patch catalog that this package depends on without upstream promising it:
private (underscore) attributes we read or mutate, and methods we replace on upstream instances.

Declared here so that a version bump is flagged by ``tests/patching/test_upstream_names.py`` (each name must
exist in the pinned vLLM and LMCache) instead of failing at run time. Add an entry with every new such access.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class UpstreamName:
    """``owner`` is ``module:Qualname`` (a class or module); ``attribute`` is read, mutated or replaced there.

    ``instance``: the attribute is set on instances (``self.<attribute> = ...`` in the class's source, or
    ``<x>.<attribute> = ...`` in the module's when ``owner`` is a module), not on the class; ``used_in``: our
    module that depends on it.
    """

    owner: str
    attribute: str
    used_in: str
    instance: bool = False


_V1_IMPL = "lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl"
_IMPL = "integration/vllm/"

UPSTREAM_NAMES: tuple[UpstreamName, ...] = (
    # vLLM's connector factory: vllm-ascend's entry for its LMCache name is replaced in the private registry
    # (no public call replaces a name); our own name goes through the public register_connector.
    UpstreamName("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory", "_registry",
                 "integration/vllm/ascend_registration.py"),
    # vLLM's connector base class: our engine impl reads the parent's per-step metadata and cache config.
    UpstreamName("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "_get_connector_metadata",
                 _IMPL + "worker_loads.py"),
    UpstreamName("vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1", "_kv_cache_config",
                 _IMPL + "vllm_compat.py", instance=True),
    # vLLM's CPU attention backend: which kernel ISA (hence cache layout) it picks, for layers not recording it.
    UpstreamName("vllm.v1.attention.backends.cpu_attn", "_get_attn_isa", _IMPL + "vllm_compat.py"),
    # vLLM's connector metrics base class: our Prometheus families are built with the metric classes it was given.
    *(UpstreamName("vllm.distributed.kv_transfer.kv_connector.v1.metrics:KVConnectorPromMetrics", name,
                   "integration/vllm/stats.py", instance=True) for name in ("_counter_cls", "_histogram_cls")),
    # LMCache's vLLM adapter: MultiGroupConnectorImpl subclasses it (through impl_state.ImplState) and uses its
    # private state, each name where it is read first.
    UpstreamName(_V1_IMPL, "_init_connector_state", _IMPL + "impl_state.py"),
    UpstreamName(_V1_IMPL, "_apply_extra_config", _IMPL + "impl_state.py"),
    UpstreamName(_V1_IMPL, "_setup_metrics", _IMPL + "engine_impl.py"),
    *(UpstreamName(_V1_IMPL, name, _IMPL + module, instance=True) for name, module in (
        ("_parent", "impl_state.py"), ("_role", "engine_impl.py"), ("_block_size", "impl_state.py"),
        ("_vllm_config", "lifecycle.py"),
        ("_manager", "engine_impl.py"), ("_lmcache_chunk_size", "lifecycle.py"),
        ("_discard_partial_chunks", "scheduler_side.py"), ("_request_trackers", "scheduler_side.py"),
        ("_unfinished_requests", "scheduler_side.py"), ("_requests_priority", "scheduler_side.py"),
        ("_max_tokens_per_load", "scheduler_side.py"),
        ("_invalid_block_ids", "worker_loads.py"), ("_stats_monitor", "worker_loads.py"))),
    # LMCache's fs:// connector: the batched read finds an object's file and reads it with O_DIRECT as upstream.
    *(UpstreamName("lmcache.v1.storage_backend.connector.fs_connector:FSConnector", name,
                   "upstream_fixes/fs_reads.py") for name in ("_get_file_path", "_get_with_odirect")),
    # LMCache's remote backend: whether it skips writes (MLA, worker 0 only), read before tracking a batch.
    UpstreamName("lmcache.v1.storage_backend.remote_backend:RemoteBackend", "_mla_worker_id_as0_mode",
                 "upstream_fixes/remote_puts.py", instance=True),
    # LMCache's manager: its silent "degraded mode" flag and reason.
    UpstreamName("lmcache.v1.manager:LMCacheManager", "_init_failed", "integration/vllm/health.py", instance=True),
    UpstreamName("lmcache.v1.manager:LMCacheManager", "_init_failed_reason", "integration/vllm/health.py",
                 instance=True),
    # LMCache's device ops: our NPU ops subclass binds LMCache-Ascend's kernels once, under upstream's guard.
    UpstreamName("lmcache.v1.platform.base.device_ops:DeviceOps", "_native_bound", "lmcache_platforms_npu_device.py",
                 instance=True),
    # LMCache instances whose public methods we replace on the instance (connector/instance_adapter.py declares
    # each change, when and why).
    *(UpstreamName("lmcache.v1.metadata:LMCacheMetadata", name, "connector/instance_adapter.py")
      for name in ("get_shapes", "get_dtypes", "get_num_groups")),
    *(UpstreamName("lmcache.v1.cache_engine:LMCacheEngine", name, "connector/instance_adapter.py")
      for name in ("store", "lookup")),
    # The standard library's private hooks.
    UpstreamName("threading", "_register_atexit", "integration/vllm/exit_shutdown.py"),
    UpstreamName("importlib._bootstrap", "_initializing", "patching/registry.py", instance=True),
)
