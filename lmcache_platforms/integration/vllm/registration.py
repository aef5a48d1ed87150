"""Our connector names in vLLM's ``KVConnectorFactory`` (called by activation when vLLM's factory loads).

``register_connector`` refuses a name twice, so an existing entry is popped first; calling this again is
harmless. ``LMCacheAscendConnector`` is only claimed where vllm-ascend is installed (that is the name its
users configure), through ``ascend_registration`` which copes with either plugin running first.
"""

from __future__ import annotations

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
    """Register (or re-register) our names with vLLM's connector factory; returns them."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    KVConnectorFactory._registry.pop(CONNECTOR_CLASS, None)
    KVConnectorFactory.register_connector(CONNECTOR_CLASS, CONNECTOR_MODULE, CONNECTOR_CLASS)
    if vllm_ascend_installed():
        claim_ascend_connector_name(KVConnectorFactory, (CONNECTOR_MODULE, CONNECTOR_CLASS))
    return connector_names()
