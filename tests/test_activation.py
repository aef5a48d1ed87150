"""Activation as a user meets it: in a fresh interpreter, with and without the opt-out switch."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import lmcache_platforms
from lmcache_platforms import activation


def _run(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env={**os.environ, **env})


def _fresh(code: str, **env: str) -> str:
    return _run(code, **env).stdout.strip().splitlines()[-1]


def test_import_activates_once_without_importing_upstream():
    code = ("import sys, json, lmcache_platforms as p; p.activate(); p.activate();"
            "print(json.dumps([p.status(), 'lmcache' in sys.modules, 'vllm' in sys.modules]))")
    state, lmcache_loaded, vllm_loaded = json.loads(_fresh(code, LMCACHE_PLATFORMS_DISABLE=""))
    assert state["activated"] is True and state["disabled"] is False and state["error"] is None
    assert state["platform"] == "cpu"
    assert (lmcache_loaded, vllm_loaded) == (False, False)


# Run first in the child: LMCache (and vLLM) look uninstalled, as on the GPU image `make device-check` runs on.
_HIDE_UPSTREAM = """
import sys
class Hide:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("lmcache", "vllm"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, Hide())
"""


def test_without_lmcache_a_layout_import_activates_with_every_patch_not_applicable():
    """The kernel contract suite and the bench run where LMCache is not installed: importing the layout there
    activates cleanly (no error, nothing to refuse), every patch standing aside."""
    code = _HIDE_UPSTREAM + ("import json, lmcache_platforms.layout, lmcache_platforms as p; s = p.status()\n"
                             "states = sorted({x['state'] for x in s['patches']})\n"
                             "print(json.dumps([s['activated'], s['error'], states]))")
    result = _run(code, LMCACHE_PLATFORMS_DISABLE="")
    assert json.loads(result.stdout.strip().splitlines()[-1]) == [True, None, ["not applicable"]]
    assert "ERROR" not in result.stderr and "not activated" not in result.stderr, result.stderr


def test_a_failed_activation_is_logged_once_through_vllms_plugin_loader():
    """Importing the plugin's module activated the package already; the plugin call must not try again and log
    the same error a second time (it did, with the package import and the plugin both activating)."""
    code = "import vllm.plugins; vllm.plugins.load_general_plugins(); print('loaded')"
    result = _run(code, LMCACHE_PLATFORMS_DEVICE="no-such-device", LMCACHE_PLATFORMS_DISABLE="")
    assert result.stdout.strip().splitlines()[-1] == "loaded"
    assert result.stderr.count("lmcache_platforms not activated") == 1, result.stderr


def test_disable_switch_applies_nothing():
    code = ("import json, lmcache_platforms as p, lmcache.integration.vllm.vllm_v1_adapter as a;"
            "print(json.dumps([p.status(), a.LMCacheConnectorV1Impl.__module__]))")
    state, impl_module = json.loads(_fresh(code, LMCACHE_PLATFORMS_DISABLE="1"))
    assert state["disabled"] is True and state["activated"] is False
    assert state["patches"] == []
    assert impl_module == "lmcache.integration.vllm.vllm_v1_adapter"


def test_activation_is_idempotent_in_process():
    first = lmcache_platforms.activate()
    assert lmcache_platforms.activate() is first
    assert activation.summary(first).startswith("platform=cpu; patches: ")


def test_unknown_upstream_version_fails_activation_and_is_reported(monkeypatch):
    from lmcache_platforms.patching import registry
    from lmcache_platforms.patching.patch import Patch
    from lmcache_platforms.upstream_fixes.catalog import PATCHES

    fake = Patch(target="json:dumps", replacement="json:loads", versions="lmcache==0.5.6")
    monkeypatch.setattr(activation, "PATCHES", (*PATCHES, fake))
    monkeypatch.setattr(registry, "installed_version", lambda name: "0.0.1")
    activation.reset_for_tests()
    try:
        try:
            activation.activate()
        except registry.UnsupportedUpstreamVersion as exc:
            message = str(exc)
        else:
            raise AssertionError("activation accepted an unknown lmcache version")
        assert "installed lmcache 0.0.1 is not a version these patches know (known: ==0.5.6)" in message
        state = lmcache_platforms.status()
        assert state["activated"] is False and "UnsupportedUpstreamVersion" in state["error"]
        import json as json_module

        assert json_module.dumps.__module__ == "json"
    finally:
        monkeypatch.undo()
        activation.reset_for_tests()
        activation.activate()


def test_lmcache_device_backend_is_chosen_only_where_we_add_a_spec():
    environ: dict[str, str] = {}
    activation._select_lmcache_device_backend(None, environ)
    assert environ == {}
    activation._select_lmcache_device_backend("lmcache_platforms_npu", environ)
    assert environ == {"LMCACHE_DEVICE_BACKEND": "lmcache_platforms_npu"}
    environ["LMCACHE_DEVICE_BACKEND"] = "user_choice"
    activation._select_lmcache_device_backend("lmcache_platforms_npu", environ)
    assert environ == {"LMCACHE_DEVICE_BACKEND": "user_choice"}


def test_connector_code_refuses_to_run_when_disabled():
    code = ("from lmcache_platforms.activation import ensure_patched\n"
            "try:\n    ensure_patched()\nexcept RuntimeError as exc:\n    print(exc)\n")
    assert _fresh(code, LMCACHE_PLATFORMS_DISABLE="1") == (
        "lmcache_platforms is disabled (LMCACHE_PLATFORMS_DISABLE=1), so its connector cannot run: "
        "unset LMCACHE_PLATFORMS_DISABLE or configure another connector")


def test_ensure_patched_applies_the_catalog_for_imported_upstream():
    state = activation.ensure_patched()
    import lmcache.integration.vllm.lmcache_connector_v1 as upstream_connector

    from lmcache_platforms.integration.vllm.engine_impl import MultiGroupConnectorImpl

    assert activation.ensure_patched() is state
    assert upstream_connector.LMCacheConnectorV1Impl is MultiGroupConnectorImpl


def _activate_against_lmcache_040(tmp_path, allow: str) -> tuple[dict, str, str]:
    """Activation in a fresh interpreter whose metadata says lmcache 0.4.0 (tests/shadow_dist.py); then
    LMCache's CPU tier module is imported: the status, who owns its patched ``LocalCPUBackend.remove``, the log."""
    from tests.shadow_dist import env_with, shadow_distribution

    code = ("import json, lmcache_platforms as p, lmcache.v1.storage_backend.local_cpu_backend as g;"
            "print(json.dumps([p.status(), g.LocalCPUBackend.remove.__module__]))")
    env = env_with(shadow_distribution(tmp_path, "lmcache", "0.4.0"), LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=allow)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                          env=env)
    state, owner = json.loads(done.stdout.strip().splitlines()[-1])
    return state, owner, done.stderr


@pytest.mark.parametrize("allow", ["", "0"])
def test_an_unknown_lmcache_version_is_refused_without_the_variable(tmp_path, allow):
    state, owner, _ = _activate_against_lmcache_040(tmp_path, allow)
    assert state["activated"] is False and not any(p["applied"] for p in state["patches"])
    assert state["error"] == (
        "UnsupportedUpstreamVersion: installed lmcache 0.4.0 is not a version these patches know (known: ==0.5.6) "
        "(set LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1 to try anyway)")
    assert owner == "lmcache.v1.storage_backend.local_cpu_backend"


@pytest.mark.parametrize("allow", ["1", "YES"])
def test_allow_unknown_versions_from_the_environment_patches_with_a_warning(tmp_path, allow):
    state, owner, log = _activate_against_lmcache_040(tmp_path, allow)
    assert state["activated"] is True and state["error"] is None
    assert owner == "lmcache_platforms.connector.tier_watch"
    assert "installed lmcache 0.4.0 is not a version these patches know (known: ==0.5.6); patching anyway because " \
           "LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1" in log
