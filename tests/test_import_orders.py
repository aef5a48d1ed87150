"""Whatever the order of imports, our connector name resolves in vLLM's real factory and LMCache is patched.

Each case starts from a fresh import state (a process imports each module once, so an order cannot be replayed
in this one): a child forked by ``tests.fork_server``, which has imported torch, transformers and vLLM's config
modules and nothing the cases order, imports vLLM's connector factory, LMCache's vLLM adapter and activates us, in
some order, then prints one JSON line made by ``_probe``. The bug these guard against: activation registered its
post-import hook on the factory before marking itself active, so where the factory was already imported wrapt ran
the hook at once, it saw no active state, and vLLM later raised ``Unsupported connector type:
LMCachePlatformsConnector``.

Why this set covers it. Importing LMCache's adapter imports vLLM's factory too (every case records whether the
factory was loaded when activation began and asserts it), so of the six orders four activate with the factory
already imported (the bug's path) and two before it (the deferred hook's path); every order runs for each of the
four ways to activate. A fresh interpreter per case cost 8.5-16 s (these 30 cases: 4.4 minutes in CI); a forked
child costs ~2 s, its imports of vLLM's factory and LMCache being all that is left.

Found while writing these: LMCache imports every ``lmcache.device_plugins`` entry point while it imports, and ours
lived inside the package, so ``import lmcache`` imported ``lmcache_platforms`` as a mere parent (then no
activation) and a later ``import lmcache_platforms`` did nothing. The plugin is now the top-level module
``lmcache_platforms_npu_device``; the ``import`` orders where LMCache comes first guard that. Since then any
import of the package activates it, patches waiting for their modules (the submodule test below).
"""

from __future__ import annotations

import inspect
import itertools
import json
from typing import Any

import pytest

from tests.fork_server import clean_environment, run_script

FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"
ADAPTER = "lmcache.integration.vllm.vllm_v1_adapter"
CONNECTOR_NAME = "LMCachePlatformsConnector"
OUR_CONNECTOR = "lmcache_platforms.integration.vllm.connector.LMCachePlatformsConnector"
OUR_IMPL = "lmcache_platforms.integration.vllm.engine_impl.MultiGroupConnectorImpl"
UPSTREAM_IMPL = "lmcache.integration.vllm.vllm_v1_adapter.LMCacheConnectorV1Impl"
UPSTREAM_GPU_FACTORY = "lmcache.v1.gpu_connector.CreateGPUConnector"

IMPORTS = {"factory": f"import {FACTORY}", "adapter": f"import {ADAPTER}"}
ACTIVATIONS = {
    "import": "import lmcache_platforms",
    "plugin": "import vllm.plugins\nvllm.plugins.load_general_plugins()",
    "connector": ("import lmcache_platforms.integration.vllm.connector\n"
                  "import lmcache_platforms.activation\n"
                  "lmcache_platforms.activation.ensure_patched()"),
    "cli": "import lmcache_platforms.cli.main\nlmcache_platforms.cli.main.main(['plan', '--layout', 'llama'])",
}
ORDERS = list(itertools.permutations(("factory", "adapter", "activate")))


def _probe() -> dict[str, Any]:
    """Runs in the subprocess (its source is sent): what vLLM's factory makes of our name, what LMCache's patched
    names are bound to, and our state, read without activating (``status()`` would activate)."""
    import importlib

    connector_v1 = importlib.import_module("lmcache.integration.vllm.lmcache_connector_v1")
    adapter = importlib.import_module("lmcache.integration.vllm.vllm_v1_adapter")
    gpu_connector = importlib.import_module("lmcache.v1.gpu_connector")
    activation = importlib.import_module("lmcache_platforms.activation")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

    def name(obj: Any) -> str | None:
        return None if obj is None else f"{obj.__module__}.{obj.__qualname__}"

    report: dict[str, Any] = {"in_registry": "LMCachePlatformsConnector" in KVConnectorFactory._registry}
    config = KVTransferConfig(kv_connector="LMCachePlatformsConnector", kv_role="kv_both")
    try:
        cls = KVConnectorFactory.get_connector_class(config)
    except ValueError as exc:
        report["connector_error"] = str(exc)
    else:
        ours = importlib.import_module("lmcache_platforms.integration.vllm.connector").LMCachePlatformsConnector
        report.update(connector=name(cls), connector_is_ours=cls is ours, subclasses_hma=issubclass(cls, SupportsHMA),
                      hma_config=KVConnectorFactory.supports_hma_config(config))
    create = gpu_connector.CreateGPUConnector
    report.update(adapter_impl=name(adapter.LMCacheConnectorV1Impl),
                  connector_v1_impl=name(connector_v1.LMCacheConnectorV1Impl),
                  create_gpu_connector=name(create), create_gpu_connector_wraps=name(getattr(create, "upstream", None)))
    state = activation._state
    report["state"] = None if state is None else {"activated": state.activated, "disabled": state.disabled,
                                                  "error": state.error}
    if state is not None:
        status = activation.status()
        report.update(status_connectors=status["connectors"]["state"], status_patches=len(status["patches"]))
    return report


def _fresh(body: str, **env: str) -> list[dict[str, Any]]:
    """Run ``body`` in a fresh import state (a child of the fork server) with ``_probe`` defined;
    ``results.append(_probe())`` collects reports. Our JSON is the last stdout line (the CLI prints before it)."""
    prelude = ["from __future__ import annotations", "import json, sys", "from typing import Any", "results = []"]
    script = "\n".join([*prelude, inspect.getsource(_probe), body, "print(json.dumps(results))"])
    result = run_script(script, clean_environment(**env), timeout=300)
    assert result.returncode == 0, f"script failed ({result.returncode}):\n{result.stderr[-4000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def _assert_active(report: dict[str, Any]) -> None:
    """What a vLLM process needs: our name resolves to our HMA connector, LMCache's names are ours, and
    ``status()`` says registered."""
    assert "connector_error" not in report, f"{CONNECTOR_NAME} does not resolve: {report['connector_error']}"
    assert report["connector"] == OUR_CONNECTOR and report["connector_is_ours"], report
    assert report["subclasses_hma"] is True and report["hma_config"] is True, report
    assert report["adapter_impl"] == OUR_IMPL and report["connector_v1_impl"] == OUR_IMPL, report
    # LMCache's GPU connector factory stays upstream's for every other engine: our impl's engine gets our
    # connector from our service factory (integration/vllm/service_factory.py).
    assert report["create_gpu_connector"] == UPSTREAM_GPU_FACTORY, report
    assert report["create_gpu_connector_wraps"] is None, report
    assert report["state"] == {"activated": True, "disabled": False, "error": None}, report
    assert report["status_connectors"] == "registered", report


def _assert_untouched(report: dict[str, Any]) -> None:
    """Nothing of ours in vLLM's factory and LMCache's names are upstream's."""
    assert report["in_registry"] is False, report
    assert report["connector_error"] == f"Unsupported connector type: {CONNECTOR_NAME}", report
    assert report["adapter_impl"] == UPSTREAM_IMPL and report["connector_v1_impl"] == UPSTREAM_IMPL, report
    assert report["create_gpu_connector"] == UPSTREAM_GPU_FACTORY, report
    assert report["create_gpu_connector_wraps"] is None, report


def _order_body(source: str, order: tuple[str, ...]) -> str:
    """The three steps in ``order``; records whether vLLM's factory was loaded when activation began."""
    lines = []
    for step in order:
        if step == "activate":
            lines.append(f"factory_before = {FACTORY!r} in sys.modules")
            lines.append(ACTIVATIONS[source])
        else:
            lines.append(IMPORTS[step])
    return "\n".join([*lines, "results.append({'factory_before_activation': factory_before, **_probe()})"])


def _order_cases() -> list[Any]:
    return [pytest.param(source, order, id=f"{source}-{'-'.join(order)}")
            for source, order in itertools.product(ACTIVATIONS, ORDERS)]


@pytest.mark.parametrize(("source", "order"), _order_cases())
def test_every_import_order_resolves_our_connector_and_patches(source: str,
                                                                order: tuple[str, ...]) -> None:
    (report,) = _fresh(_order_body(source, order))
    # LMCache's adapter imports vLLM's factory, so the factory is loaded first unless activation comes first.
    assert report.pop("factory_before_activation") is (order[0] != "activate")
    _assert_active(report)


def test_the_check_detects_the_old_hook_order() -> None:
    """The old bug put back (the hook registered while the state is not yet set, factory imported first):
    ``_assert_active`` must fail with vLLM's own error, so the cases above can fail. The stand-in for wrapt's
    registration goes in before the package is imported, since importing it activates."""
    body = "\n".join([
        f"import {FACTORY}",
        "import wrapt",
        "register = wrapt.register_post_import_hook",
        "def register_before_state(hook, name):",
        "    if getattr(hook, '__name__', '') != '_register_connectors':",
        "        return register(hook, name)",
        "    activation = sys.modules['lmcache_platforms.activation']",
        "    state, activation._state = activation._state, None",
        "    try:",
        "        return register(hook, name)",
        "    finally:",
        "        activation._state = state",
        "wrapt.register_post_import_hook = register_before_state",
        "import lmcache_platforms",
        f"import {ADAPTER}",
        "results.append(_probe())",
    ])
    (report,) = _fresh(body)
    assert report["status_connectors"] == "waiting for vLLM"
    with pytest.raises(AssertionError, match=f"Unsupported connector type: {CONNECTOR_NAME}"):
        _assert_active(report)


def _before_upstream() -> dict[str, Any]:
    """Runs in the subprocess before anything imports LMCache: whether it is, and what activation did (read from
    its state: ``_probe`` would import LMCache). The fork server's child has vLLM's config modules already."""
    import sys

    state = sys.modules["lmcache_platforms.activation"]._state
    imported = {name.split(".")[0] for name in sys.modules}
    return {"lmcache_imported": "lmcache" in imported,
            "activated": state is not None and state.activated,
            "patch_states": sorted({r.state.value for r in state.registry.records}) if state is not None else []}


@pytest.mark.parametrize("submodule", ["layout", "kernels", "activation"])
def test_a_submodule_import_activates_but_patches_nothing_until_upstream_is_imported(submodule: str) -> None:
    """Tools that use only the layout math or the kernels never import LMCache or vLLM, so their process is left
    as it was: activation only waits for upstream's modules. Once a process imports them (in any order, long
    after the submodule), they are patched and our connector resolves, with no further call."""
    body = "\n".join([
        f"import lmcache_platforms.{submodule}",
        "results.append(_before_upstream())",
        f"import {ADAPTER}",
        f"import {FACTORY}",
        "results.append(_probe())",
    ])
    prelude = inspect.getsource(_before_upstream)
    before, after = _fresh(f"{prelude}\n{body}")
    assert before == {"lmcache_imported": False, "activated": True, "patch_states": ["not applicable", "pending"]}
    _assert_active(after)


def test_disable_switch_through_vllm_plugin_loader_registers_and_patches_nothing() -> None:
    body = "\n".join([f"import {FACTORY}", f"import {ADAPTER}", "import vllm.plugins",
                      "vllm.plugins.load_general_plugins()", "results.append(_probe())"])
    (report,) = _fresh(body, LMCACHE_PLATFORMS_DISABLE="1")
    assert report["state"] == {"activated": False, "disabled": True, "error": None}, report
    assert report["status_patches"] == 0, report
    _assert_untouched(report)
