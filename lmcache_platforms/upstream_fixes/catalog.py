"""The one list of every upstream symbol lmcache_platforms replaces. Nothing is patched anywhere else.

Replacements are named as ``module:attr`` strings: most of their modules import LMCache or vLLM, which must not
be imported before the patched module is (``patching.registry`` resolves them then)."""

from __future__ import annotations

from lmcache_platforms.patching.patch import Patch

LMCACHE = "lmcache==0.5.6"
VLLM = "vllm>=0.23,<0.34"
KEEP_UPSTREAM_ADAPTER = "LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER"

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
        kept_by=KEEP_UPSTREAM_ADAPTER,
        why="upstream's in-process impl tracks KV-cache group 0 only; ours tracks, saves and loads every group "
            "and reports degraded mode (vLLM's LMCacheConnectorV1 looks the name up in this module at init); "
            "it honours each wrapper's contract (integration/vllm/wrapper_contract.py). With "
            f"{KEEP_UPSTREAM_ADAPTER}=1 upstream's stays, and only LMCachePlatformsConnector runs ours",
    ),
    *(Patch(
        target=f"lmcache.v1.storage_backend.{module}:{backend}.remove",
        replacement="lmcache_platforms.connector.tier_watch:wrap_remove",
        versions=LMCACHE,
        wrapper=True,
        why="upstream tells only its cache controller what a local tier evicts or removes; the KV events tell "
            "routers (BlockRemoved), through a listener for the engine's own backend (connector.tier_watch)",
    ) for module, backend in (("local_cpu_backend", "LocalCPUBackend"), ("local_disk_backend", "LocalDiskBackend"))),
    Patch(
        target="lmcache.v1.storage_backend.storage_manager:StorageManager.batched_get",
        replacement="lmcache_platforms.connector.tier_watch:wrap_batched_get",
        versions=LMCACHE,
        wrapper=True,
        why="upstream says nowhere which tier served a load; the connector statistics count the bytes read per "
            "tier, through a listener for the engine's own storage manager (connector.tier_watch)",
    ),
    Patch(
        target="lmcache.v1.offload_server.zmq_server:ZMQOffloadServer",
        replacement="lmcache_platforms.upstream_fixes.offload_server:SafeCloseOffloadServer",
        versions=LMCACHE,
        stale_copies=("lmcache.integration.vllm.vllm_service_factory", "lmcache.v1.manager"),
        requires=("vllm",),
        why="upstream's close() closes the REP socket while its thread blocks in recv() on it: libzmq aborts "
            "the process at shutdown when vLLM runs in one process (the usual CPU set-up); its loop leaves a "
            "malformed or failing request unanswered, which ends the thread",
    ),
    Patch(
        target="lmcache.v1.storage_backend.job_executor.pq_executor:AsyncPQExecutor.shutdown",
        replacement="lmcache_platforms.upstream_fixes.remote_close:pq_executor_shutdown",
        versions=LMCACHE,
        why="remote backends (Redis, S3, ...) await shutdown() from their executor's own loop while it blocks on "
            "that loop, so destroying an engine with a remote_url hangs for ever",
    ),
    Patch(
        target="lmcache.v1.storage_backend.remote_backend:RemoteBackend.close",
        replacement="lmcache_platforms.upstream_fixes.remote_close:wrap_remote_close",
        versions=LMCACHE,
        wrapper=True,
        why="a connector's close drains its job queue after LMCache's executor cancelled the workers, so with a "
            "job waiting on a store that does not answer, the engine's shutdown never ends "
            "(platforms.remote_close_timeout_s)",
    ),
    Patch(
        target="lmcache.v1.storage_backend.remote_backend:RemoteBackend.contains",
        replacement="lmcache_platforms.upstream_fixes.remote_lookup:wrap_remote_contains",
        versions=LMCACHE,
        wrapper=True,
        why="upstream waits for the remote store's answer without a limit; the scheduler's lookup client gives up "
            "after 3 s, so a stuck store stalled the whole engine 3 s per new request; a slow one is skipped for a "
            "time in proportion to its lateness, and its first ask (connecting) has its own allowance "
            "(platforms.remote_lookup_timeout_s, platforms.remote_connect_timeout_s, platforms.remote_retry_s)",
    ),
    Patch(
        target="lmcache.v1.storage_backend.remote_backend:RemoteBackend.batched_contains",
        replacement="lmcache_platforms.upstream_fixes.remote_lookup:wrap_remote_batched_contains",
        versions=LMCACHE,
        wrapper=True,
        why="the batched form of the same unbounded wait (connectors with a batched exists, e.g. RESP)",
    ),
    Patch(
        target="lmcache.v1.storage_backend.local_disk_backend:LocalDiskBackend.read_file",
        replacement="lmcache_platforms.upstream_fixes.disk_reads:checked_read_file",
        versions=LMCACHE,
        wrapper=True,
        why="upstream never checks how many bytes a chunk's file gave: a file cut short (or, on the single-chunk "
            "path, a missing one) is loaded as a hit whose tail is the buffer's stale bytes; it now raises",
    ),
    Patch(
        target="lmcache.v1.storage_backend.local_disk_backend:LocalDiskBackend.load_bytes_from_disk",
        replacement="lmcache_platforms.upstream_fixes.disk_reads:load_bytes_from_disk",
        versions=LMCACHE,
        why="the single-chunk disk read (get_blocking) must turn a chunk file that cannot be its bytes into a "
            "miss that frees its buffer, as upstream's batched read already does",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.redis_connector:RedisConnector._get",
        replacement="lmcache_platforms.upstream_fixes.redis_reads:redis_get",
        versions=LMCACHE,
        requires=("redis",),
        why="a Redis value of the wrong length (truncated, overwritten) made upstream's copy raise after it had "
            "allocated the chunk's buffer, which stayed taken until the garbage collector found it",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.redis_connector:RedisClusterConnector._get",
        replacement="lmcache_platforms.upstream_fixes.redis_reads:redis_cluster_get",
        versions=LMCACHE,
        requires=("redis",),
        why="the Redis Cluster connector (redis-cluster://) copies a value the same way: one of the wrong length "
            "kept the chunk's buffer taken",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.support_batched_get",
        replacement="lmcache_platforms.upstream_fixes.batched_remote:wrap_supports_batched",
        versions=LMCACHE,
        wrapper=True,
        why="the Redis connectors fetch a chunk object's two values one after the other, four objects at a time, "
            "and fs:// hands every step of every read to a thread: a load of a 2,048-token hit was dozens of "
            "round trips or hand-offs; they now announce the batched read below",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.batched_get",
        replacement="lmcache_platforms.upstream_fixes.batched_remote:wrap_batched_get",
        versions=LMCACHE,
        wrapper=True,
        why="for the Redis connectors, every object of a load in one pipeline (one round trip, one per node on a "
            "cluster), each value checked as the single read checks it; for fs://, every file in one thread job",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.support_batched_contains",
        replacement="lmcache_platforms.upstream_fixes.batched_remote:wrap_supports_batched",
        versions=LMCACHE,
        wrapper=True,
        why="the Redis connectors answer a lookup with one EXISTS round trip per object, each waiting for the "
            "last, fs:// with one thread hand-off per object; they now announce the batched lookup below",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.batched_contains",
        replacement="lmcache_platforms.upstream_fixes.batched_remote:wrap_batched_contains",
        versions=LMCACHE,
        wrapper=True,
        why="for the Redis connectors, a lookup's EXISTS for every object in one pipeline; for fs://, the files "
            "tested in the calling thread",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.redis_connector:RedisConnector._batched_async_contains",
        replacement="lmcache_platforms.upstream_fixes.redis_reads:redis_async_contains",
        versions=LMCACHE,
        requires=("redis",),
        why="the asynchronous lookup (async loading) asks one EXISTS at a time as well; one pipeline instead",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.redis_connector:RedisClusterConnector._batched_async_contains",
        replacement="lmcache_platforms.upstream_fixes.redis_reads:redis_async_contains",
        versions=LMCACHE,
        requires=("redis",),
        why="the same one-at-a-time asynchronous lookup on a Redis Cluster",
    ),
    Patch(
        target="lmcache.v1.storage_backend.connector.base_connector:RemoteConnector.remove_sync",
        replacement="lmcache_platforms.upstream_fixes.redis_reads:wrap_remote_remove_sync",
        versions=LMCACHE,
        wrapper=True,
        why="the Redis and Redis Cluster connectors inherit remove_sync unimplemented, so a chunk object that "
            "failed its checksum could not be removed and every later lookup would hit it again",
    ),
    Patch(
        target="lmcache.v1.storage_backend.remote_backend:RemoteBackend.batched_submit_put_task",
        replacement="lmcache_platforms.upstream_fixes.remote_puts:wrap_batched_submit_put_task",
        versions=LMCACHE,
        wrapper=True,
        why="a batch of writes (how both Redis connectors write) never entered put_tasks, so nothing waited for "
            "it: an engine closed right after a store lost those chunks",
    ),
    *(Patch(
        target=f"lmcache.v1.lookup_client.lmcache_async_lookup_client:LMCacheAsyncLookup{side}.{method}",
        replacement=f"lmcache_platforms.upstream_fixes.async_lookup_close:wrap_{side.lower()}_{method.strip('_')}",
        versions=LMCACHE,
        wrapper=True,
        why="LMCache's async loading (enable_async_loading): close() closes the PULL socket under the thread "
            "blocked in recv() on it, and libzmq aborts the vLLM process at every shutdown; the thread is woken "
            "first (its socket's address recorded at __init__)",
    ) for side in ("Client", "Server") for method in ("__init__", "close")),
    Patch(
        target="lmcache.integration.vllm.utils:_vllm_local_device_index",
        replacement="lmcache_platforms.integration.vllm.dp_device:wrap_local_device_index",
        versions=LMCACHE,
        requires=("vllm",),
        wrapper=True,
        why="where vLLM gives each data-parallel engine its own device table (CPU, NPU, Ray), upstream still "
            "offsets a worker's device by its data-parallel rank: every rank but 0 failed LMCache's start-up "
            "and recomputed everything in degraded mode",
    ),
    Patch(
        target="vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory.register_connector",
        replacement="lmcache_platforms.integration.vllm.ascend_registration:guard_register_connector",
        versions=VLLM,
        requires=("vllm", "vllm_ascend"),
        wrapper=True,
        why="vllm-ascend registers LMCacheAscendConnector from its own plugin; if ours ran first, vLLM would "
            "raise on the duplicate name instead of keeping our HMA connector",
    ),
)
