"""Build our scheduler-side connector through vLLM's factory with kv_connector_extra_config it must refuse (or accept).

Run as a module in a subprocess: a refused connector leaves LMCache's services, started by upstream's
``__init__`` before our checks run, with open ZMQ sockets that would block every later shutdown in the
process. Prints one JSON object: each case's error (``"TypeName: message"``), or null if it was accepted.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lmcache_platforms  # noqa: F401 - activation, as the vllm.general_plugins entry point does

CASES: dict[str, dict[str, Any]] = {
    "use_layerwise": {"lmcache.use_layerwise": True},
    "bad_mode": {"platforms.mode": "fused"},
    "lmcache_async_loading": {"lmcache.enable_async_loading": True},
    "lmcache_blending": {"lmcache.enable_blending": True},
    "cachegen_serde": {"lmcache.remote_serde": "cachegen"},
}


def attempt(model: Path, extra: dict[str, Any]) -> str | None:
    """The error building the connector raised, or None (the connector is then shut down)."""
    from lmcache.integration.vllm.utils import lmcache_get_or_create_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from tests.integration.specs import gemma_like
    from tests.integration.vllm_env import vllm_config

    lmcache_config = lmcache_get_or_create_config()
    saved = dict(vars(lmcache_config))  # LMCache's adapter writes lmcache.* keys into its process-wide config
    try:
        connector = KVConnectorFactory.create_connector(vllm_config(model, "LMCachePlatformsConnector", **extra),
                                                        KVConnectorRole.SCHEDULER, gemma_like())
    except Exception as exc:  # noqa: BLE001 - the error is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        vars(lmcache_config).update(saved)
    connector.shutdown()
    return None


def main(model: str) -> None:
    print(json.dumps({name: attempt(Path(model), extra) for name, extra in CASES.items()}))


if __name__ == "__main__":
    main(sys.argv[1])
