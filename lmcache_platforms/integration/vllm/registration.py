"""Our connector names in vLLM's ``KVConnectorFactory`` (called by activation when vLLM's factory loads).

Only vLLM's public ``register_connector`` is used: the zero-config ``"kv_connector": "LMCachePlatformsConnector"``
needs a registered name (``kv_connector_module_path`` would make users name our module). It refuses a name
twice with ValueError, which a second call meets and ignores: the entry already loads our class.
``LMCacheAscendConnector`` is only claimed where vllm-ascend is installed (that is the name its
users configure), through ``ascend_registration`` which copes with either plugin running first.
"""

from __future__ import annotations

import contextlib

from lmcache_platforms.integration.vllm.ascend_registration import (
    ASCEND_CONNECTOR_NAME,
    claim_ascend_connector_name,
    vllm_ascend_installed,
)

CONNECTOR_MODULE = "lmcache_platforms.integration.vllm.connector"
CONNECTOR_CLASS = "LMCachePlatformsConnector"


def connector_names() -> list[str]:
    """The names we register in this environment."""
    return [CONNECTOR_CLASS, *([ASCEND_CONNECTOR_NAME] if vllm_ascend_installed() else [])]


def register_connectors() -> list[str]:
    """Register our names with vLLM's connector factory (again is harmless); returns them."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered by an earlier call
        KVConnectorFactory.register_connector(CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_CLASS)
    if vllm_ascend_installed():
        claim_ascend_connector_name(KVConnectorFactory, (CONNECTOR_MODULE, CONNECTOR_CLASS))
    return connector_names()
