"""The check that a catalog patch really replaces what upstream callers use, for one patch.

``tests/upstream_fixes/test_catalog.py`` runs it in its own process for patches whose modules the venv has, and in
a subprocess (``python -m tests.upstream_fixes.catalog_check TARGET``) for the ones that need a module the CPU venv
lacks by design, put on the path from its pinned source tree: vllm-ascend for the guard on vLLM's
``KVConnectorFactory.register_connector``. There it also runs vllm-ascend's own connector registration after
ours, which is what the guard is for. Prints one JSON line; a failed check exits non-zero.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any

from lmcache_platforms.patching.patch import Patch, resolve, resolve_owner


def check_patch(patch: Patch) -> None:
    """The object upstream callers reach is ours (or, for a wrapper, the wrapper around the original), and so
    are the stale ``from X import Y`` copies."""
    import lmcache_platforms

    assert lmcache_platforms.status()["activated"]
    owner, name = resolve_owner(importlib.import_module(patch.module), patch.attr)
    installed = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    ours = resolve(patch.replacement)
    if patch.wrapper:
        record = next(r for r in lmcache_platforms.activate().registry.records if r.patch is patch)
        assert installed is record.replacement and record.original is not installed, record
        return
    assert installed is ours
    for module_name in patch.stale_copies:
        module = importlib.import_module(module_name)
        assert getattr(module, patch.attr) is ours, f"{module_name}.{patch.attr} still holds upstream's object"


def ascend_plugin_after_ours() -> dict[str, Any]:
    """vllm-ascend's real registration (its plugin's ``register_connector`` minus the NPU patches it applies
    first, which need torch_npu) after ours: no "already registered" error, and our name stays ours."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm_ascend.distributed.kv_transfer import register_connector

    import lmcache_platforms
    from lmcache_platforms.integration.vllm.ascend_registration import ASCEND_CONNECTOR_NAME
    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector

    names = lmcache_platforms.status()["connectors"]["names"]
    assert ASCEND_CONNECTOR_NAME in names, names
    register_connector()
    assert KVConnectorFactory._registry[ASCEND_CONNECTOR_NAME]() is LMCachePlatformsConnector
    ucm = KVConnectorFactory._registry["UCMConnector"]
    assert not hasattr(ucm, "_lmcache_platforms_target")  # vllm-ascend's other names are its own
    try:
        KVConnectorFactory.register_connector("UCMConnector", "x", "y")
    except ValueError as exc:
        assert "already registered" in str(exc)
    else:
        raise AssertionError("the guard let a duplicate name other than ours through")
    return {"names": names}


def main(target: str) -> None:
    import lmcache_platforms
    from lmcache_platforms.upstream_fixes.catalog import PATCHES

    (patch,) = [p for p in PATCHES if p.target == target]
    registry = lmcache_platforms.activate().registry
    assert registry is not None
    registry.import_targets()
    record = next(r for r in registry.records if r.patch is patch)
    assert record.state.value == "applied", f"{target}: {record.state.value}: {record.detail}"
    check_patch(patch)
    extra = ascend_plugin_after_ours() if "vllm_ascend" in patch.requires else {}
    print(json.dumps({"target": target, "state": record.state.value, **extra}))


if __name__ == "__main__":
    main(sys.argv[1])
