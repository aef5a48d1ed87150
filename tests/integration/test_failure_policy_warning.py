"""The start-up warning about vLLM's kv_load_failure_policy: once per process, only for "fail" (vLLM's default)
and only for a model LMCache can serve hits for."""

from __future__ import annotations

import importlib
import logging

import pytest

from tests.integration.vllm_env import vllm_config

WARNING = "kv_load_failure_policy is 'fail'"


@pytest.fixture
def scheduler_side():
    importlib.import_module("lmcache.integration.vllm.vllm_v1_adapter")  # first, as the connector does
    module = importlib.import_module("lmcache_platforms.integration.vllm.scheduler_side")
    module._policy_warned = False
    yield module
    module._policy_warned = False


@pytest.fixture
def records(caplog):
    logger = logging.getLogger("lmcache_platforms")
    logger.addHandler(caplog.handler)
    yield caplog
    logger.removeHandler(caplog.handler)


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if WARNING in r.getMessage()]


def with_policy(model_dir, policy: str | None):
    config = vllm_config(model_dir, "LMCachePlatformsConnector")
    if policy is not None:
        config.kv_transfer_config.kv_load_failure_policy = policy
    return config


def test_vllms_default_policy_warns_once_naming_the_setting(scheduler_side, records, model_dir) -> None:
    config = with_policy(model_dir, None)
    assert config.kv_transfer_config.kv_load_failure_policy == "fail"  # vLLM's default
    scheduler_side.warn_about_failure_policy(config, hits_allowed=True)
    scheduler_side.warn_about_failure_policy(config, hits_allowed=True)
    (message,) = warnings(records)
    assert '"kv_load_failure_policy": "recompute"' in message


@pytest.mark.parametrize(("policy", "hits_allowed"), [("recompute", True), ("fail", False)])
def test_no_warning_when_recomputing_or_when_no_hit_is_ever_claimed(scheduler_side, records, model_dir, policy: str,
                                                                   hits_allowed: bool) -> None:
    scheduler_side.warn_about_failure_policy(with_policy(model_dir, policy), hits_allowed=hits_allowed)
    assert warnings(records) == []
