"""LMCache's asynchronous lookup client and server (its ``enable_async_loading``) over a real LMCacheEngine, made
and closed in this process: prints how long closing both took and whether their threads are still alive.
``upstream`` puts LMCache's own ``__init__`` and ``close`` back first (the negative control)."""

from __future__ import annotations

import sys
import time
import uuid


def main(argv: list[str]) -> int:
    from lmcache.v1.lookup_client import lmcache_async_lookup_client as lookups

    import lmcache_platforms
    from lmcache_platforms.layout import load_layout_spec
    from lmcache_platforms.patching.patch import resolve_owner
    from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions
    from lmcache_platforms.tools.fixtures import materialize

    lmcache_platforms.ensure_patched()
    if argv[0] == "upstream":
        for record in lmcache_platforms.activate().registry.records:
            if record.patch.module == lookups.__name__:
                owner, name = resolve_owner(lookups, record.patch.attr)
                setattr(owner, name, record.original)
    layout = materialize(load_layout_spec("llama"), "bundled", seed=0)
    with LayoutEngine(layout, StorageOptions(max_local_cpu_size=0.05)) as engine:
        metadata = engine.engine.metadata
        metadata.engine_id = f"async-lookup-{uuid.uuid4().hex[:8]}"  # socket paths of its own
        server = lookups.LMCacheAsyncLookupServer(engine.engine, metadata)
        client = lookups.LMCacheAsyncLookupClient(engine.engine.config, metadata)
        started = time.perf_counter()
        client.close()
        server.close()
        print(f"closed in {time.perf_counter() - started:.3f} s; threads alive: "
              f"{client.thread.is_alive()} {server.thread.is_alive()}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
