"""Make vllm-ascend's connector name ``LMCacheAscendConnector`` mean our HMA connector, in any plugin order.

vllm-ascend (0.23.x) registers that name in its ``vllm.general_plugins`` entry point
(``vllm_ascend:register_connector``) as upstream's single-group ``LMCacheConnectorV1`` behind
``import lmcache_ascend``. vLLM's factory raises on a duplicate name and vLLM does not catch errors of a
general plugin, so whichever of the two plugins runs second must not simply register: if vllm-ascend ran
first we replace its entry; if we run first we register ours, and the factory keeps it when vllm-ascend's
registration arrives thanks to ``guard_register_connector`` (a wrapper declared in the patch catalog; every
other name it registers is untouched). No source patch is needed.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

logger = init_logger(__name__)

ASCEND_CONNECTOR_NAME = "LMCacheAscendConnector"
CONNECTOR_TARGET = ("lmcache_platforms.integration.vllm.connector", "LMCachePlatformsConnector")
_OURS = "_lmcache_platforms_target"


def vllm_ascend_installed() -> bool:
    """True when vllm-ascend can be imported here (looked up without importing it)."""
    return importlib.util.find_spec("vllm_ascend") is not None


def _is_ours(loader: Any) -> bool:
    return getattr(loader, _OURS, None) is not None


def guard_register_connector(original: classmethod) -> classmethod:
    """Wrap ``KVConnectorFactory.register_connector`` (declared in the patch catalog) so that registering
    ASCEND_CONNECTOR_NAME again keeps our entry instead of raising; every other name behaves as before."""
    register = original.__func__

    def register_connector(cls: type[KVConnectorFactory], name: str, module_path: str, class_name: str) -> None:
        if name == ASCEND_CONNECTOR_NAME and _is_ours(cls._registry.get(name)):
            logger.info("%s stays lmcache_platforms' HMA connector; ignored its registration as %s:%s",
                        name, module_path, class_name)
            return
        register(cls, name, module_path, class_name)

    register_connector.__doc__ = register.__doc__
    return classmethod(register_connector)


def claim_ascend_connector_name(factory: type[KVConnectorFactory] | None = None,
                                target: tuple[str, str] = CONNECTOR_TARGET) -> str:
    """Point ASCEND_CONNECTOR_NAME at ``target`` (module, class) in vLLM's connector factory; idempotent.

    Returns what was done: ``"already registered"``, ``"replaced vllm-ascend's entry"`` or
    ``"registered ahead of vllm-ascend"``.
    """
    if factory is None:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

        factory = KVConnectorFactory
    registry = factory._registry
    existing = registry.get(ASCEND_CONNECTOR_NAME)
    if existing is not None and getattr(existing, _OURS, None) == target:
        return "already registered"
    replaced = registry.pop(ASCEND_CONNECTOR_NAME, None) is not None
    factory.register_connector(ASCEND_CONNECTOR_NAME, *target)
    setattr(registry[ASCEND_CONNECTOR_NAME], _OURS, target)
    outcome = "replaced vllm-ascend's entry" if replaced else "registered ahead of vllm-ascend"
    logger.info("%s -> %s:%s (%s)", ASCEND_CONNECTOR_NAME, *target, outcome)
    return outcome
