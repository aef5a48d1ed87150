"""Shared fixtures: the tiny model config folder and the environment LMCache needs in tests."""

from __future__ import annotations

import os

import pytest

from tests.integration.vllm_env import write_model_config

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("PYTHONHASHSEED", "0")


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    return write_model_config(tmp_path_factory.mktemp("gemma3-tiny-config"))
