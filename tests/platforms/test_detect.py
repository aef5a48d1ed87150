"""``LMCACHE_PLATFORMS_DEVICE`` as docs/configuration.md says: it forces the platform instead of detection, and a
name that is unknown or unusable here is refused, in detection and then by activation (and ``doctor``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from lmcache_platforms.platforms.detect import DEVICE_ENV, PlatformError, current_platform
from tests.platforms.fake_runtime import FakeDeviceRuntime


@pytest.fixture
def fresh_detection(monkeypatch: pytest.MonkeyPatch) -> Iterator[pytest.MonkeyPatch]:
    """``current_platform`` is cached per process: detect anew here, and again for the tests after this one."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)
    current_platform.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    current_platform.cache_clear()


@pytest.fixture
def with_xpu(fresh_detection: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """An Intel XPU visible to torch (the one runtime fake the suite allows: this machine cannot have one)."""
    fresh_detection.setattr(torch, "xpu", FakeDeviceRuntime(1, "Intel(R) Arc(TM) A770"), raising=False)
    return fresh_detection


def test_detection_picks_the_first_available_platform(with_xpu) -> None:
    assert current_platform().name == "xpu"


@pytest.mark.parametrize("value", ["cpu", " CPU ", "Cpu"])
def test_the_variable_forces_a_platform_over_detection(with_xpu, value: str) -> None:
    with_xpu.setenv(DEVICE_ENV, value)
    assert current_platform().name == "cpu"


def test_an_unavailable_platform_is_refused_with_the_reason(fresh_detection) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: LMCACHE_PLATFORMS_DEVICE=cuda is usable here")
    fresh_detection.setenv(DEVICE_ENV, "cuda")
    with pytest.raises(PlatformError, match=r"^LMCACHE_PLATFORMS_DEVICE=cuda but that platform is unavailable: "):
        current_platform()


def test_an_unknown_platform_is_refused(fresh_detection) -> None:
    fresh_detection.setenv(DEVICE_ENV, "tpu")
    with pytest.raises(PlatformError, match=r"^unknown platform 'tpu'; known: npu, xpu, cuda, cpu$"):
        current_platform()


def test_activation_reports_a_refused_platform_and_patches_nothing() -> None:
    """In a fresh interpreter, as a user meets it: import works, status() carries the error, nothing applied."""
    code = ("import json, lmcache_platforms as p, lmcache.v1.storage_backend.local_cpu_backend as g;"
            "print(json.dumps([p.status(), g.LocalCPUBackend.remove.__module__]))")
    env = {**os.environ, DEVICE_ENV: "tpu"}
    env.pop("LMCACHE_PLATFORMS_DISABLE", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env,
                          check=True)
    state, factory_module = json.loads(done.stdout.strip().splitlines()[-1])
    assert state["activated"] is False and state["platform"] is None and state["patches"] == []
    assert state["error"] == "PlatformError: unknown platform 'tpu'; known: npu, xpu, cuda, cpu"
    assert factory_module == "lmcache.v1.storage_backend.local_cpu_backend"
