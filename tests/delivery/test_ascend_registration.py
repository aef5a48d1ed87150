"""vllm-ascend's real connector registration (from its pinned sdist) against vLLM's real connector factory:
``LMCacheAscendConnector`` must end up as our connector whichever plugin runs first."""

from __future__ import annotations

import importlib.util
import sys

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

from lmcache_platforms.integration.vllm import ascend_registration as reg
from tests.delivery.pins import pins
from tests.delivery.upstream import source_tree

NAME = reg.ASCEND_CONNECTOR_NAME


class StandIn:
    """A class the tests point the name at, so they do not depend on the connector module being importable."""


TARGET = (__name__, "StandIn")


@pytest.fixture(scope="module")
def ascend_kv_transfer():
    """vllm_ascend/distributed/kv_transfer/__init__.py of the pinned release, loaded on its own."""
    root = source_tree("vllm-ascend", pins()["VLLM_ASCEND_VERSION"])
    path = root / "vllm_ascend" / "distributed" / "kv_transfer" / "__init__.py"
    spec = importlib.util.spec_from_file_location("vllm_ascend_kv_transfer_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules.pop(spec.name, None)
    assert NAME in path.read_text(), f"{path} no longer registers {NAME}"
    return module


@pytest.fixture
def factory(monkeypatch):
    """vLLM's factory with its built-in registry and the catalog's guard, restored after the test."""
    monkeypatch.setattr(KVConnectorFactory, "_registry", dict(KVConnectorFactory._registry))
    guard = reg.guard_register_connector(KVConnectorFactory.__dict__["register_connector"])
    monkeypatch.setattr(KVConnectorFactory, "register_connector", guard)
    return KVConnectorFactory


def test_ascend_plugin_first_then_ours(factory, ascend_kv_transfer):
    ascend_kv_transfer.register_connector()
    assert not hasattr(factory._registry[NAME], "_lmcache_platforms_target")
    assert reg.claim_ascend_connector_name(factory, TARGET) == "replaced vllm-ascend's entry"
    assert factory._registry[NAME]() is StandIn


def test_ours_first_then_ascend_plugin(factory, ascend_kv_transfer):
    assert reg.claim_ascend_connector_name(factory, TARGET) == "registered ahead of vllm-ascend"
    ascend_kv_transfer.register_connector()  # must not raise "already registered"
    assert factory._registry[NAME]() is StandIn
    # every other name vllm-ascend registers is still its own
    for other in ("UCMConnector", "AscendStoreConnector", "MooncakeConnectorV1"):
        assert not hasattr(factory._registry[other], "_lmcache_platforms_target"), other


def test_claim_is_idempotent(factory, ascend_kv_transfer):
    reg.claim_ascend_connector_name(factory, TARGET)
    assert reg.claim_ascend_connector_name(factory, TARGET) == "already registered"
    ascend_kv_transfer.register_connector()
    assert reg.claim_ascend_connector_name(factory, TARGET) == "already registered"
    assert factory._registry[NAME]() is StandIn


def test_guard_keeps_other_duplicates_an_error(factory):
    reg.claim_ascend_connector_name(factory, TARGET)
    with pytest.raises(ValueError, match="already registered"):
        factory.register_connector("LMCacheConnectorV1", "x", "y")


def test_default_target_is_our_hma_connector(factory):
    from lmcache_platforms.integration.vllm import connector

    reg.claim_ascend_connector_name(factory)
    assert factory._registry[NAME]() is connector.LMCachePlatformsConnector
