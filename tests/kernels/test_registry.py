"""Backend registry: names, auto order per device, explicit preferences, plugins via entry points."""

from __future__ import annotations

from importlib.metadata import EntryPoint

import pytest
import torch

from lmcache_platforms.kernels import registry
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from lmcache_platforms.platforms.detect import PLATFORM_NAMES
from tests.ci import missing
from tests.kernels.test_triton_gpu import DEVICE


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    monkeypatch.setattr(registry, "_loaded", {})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


@pytest.fixture
def native_cpu():
    """The native CPU backend these tests expect to be chosen: built by set-up (CI fails without it); a GPU
    machine running ``scripts/device_check.py`` straight from the source tree has not built it."""
    available, reason = registry.get_backend("cpu").availability()
    if not available:
        missing(reason)


def cpu_planes():
    storage = torch.zeros(64, dtype=torch.uint8)
    return [Plane("l", "k", 0, torch.uint8, PlaneGeometry(4, 16, 2, 8, 1, 8, 8), 0, storage)]


def with_plugins(monkeypatch, **targets):
    entries = {name: EntryPoint(name, value, registry.ENTRY_POINT_GROUP) for name, value in targets.items()}
    monkeypatch.setattr(registry, "_plugin_entries", lambda: entries)


def test_describe_lists_every_builtin_and_torch_is_available(native_cpu):
    rows = {row["name"]: row for row in registry.describe_backends()}
    assert list(rows)[:4] == ["torch", "cpu", "triton", "ascend"]
    assert rows["torch"]["available"] is True
    assert rows["cpu"]["available"] is True, rows["cpu"]["reason"]
    assert rows["triton"]["available"] is torch.cuda.is_available()
    assert rows["ascend"]["available"] is False
    assert all(set(row) == {"name", "available", "reason"} for row in rows.values())


def test_auto_picks_native_cpu_for_host_tensors(native_cpu):
    assert registry.select_backend(cpu_planes(), "cpu").name == "cpu"
    assert registry.select_backend(cpu_planes(), torch.device("cpu"), "auto").name == "cpu"


def test_auto_falls_back_to_torch_when_nothing_faster_is_usable():
    assert registry.select_backend(cpu_planes(), "npu").name == "torch"
    assert registry.select_backend(cpu_planes(), "cuda").name == "torch"
    assert registry.select_backend(cpu_planes(), "meta").name == "torch"


def test_explicit_preferences():
    assert registry.select_backend(cpu_planes(), "cpu", "torch").name == "torch"
    # Without a GPU Triton is unusable; with one (make device-check) it is usable but moves no host memory.
    refusal = "cannot move these planes: planes on \\['cpu'\\]" if DEVICE is not None else "is unavailable: no CUDA"
    with pytest.raises(registry.BackendUnavailable, match=f"kernel backend 'triton' {refusal}"):
        registry.select_backend(cpu_planes(), "cpu", "triton")
    with pytest.raises(registry.BackendUnavailable, match="kernel backend 'ascend' is unavailable"):
        registry.select_backend(cpu_planes(), "npu", "ascend")
    with pytest.raises(registry.BackendUnavailable, match="unknown kernel backend 'fastest'; known: torch, cpu"):
        registry.select_backend(cpu_planes(), "cpu", "fastest")


def test_explicit_preference_that_cannot_move_the_planes(monkeypatch, native_cpu):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert registry.select_backend(cpu_planes(), "cpu", "triton").name == "triton"
    meta = [Plane("l", "k", 0, torch.uint8, PlaneGeometry(4, 16, 2, 8, 1, 8, 8), 0,
                  torch.zeros(64, dtype=torch.uint8, device="meta"))]
    with pytest.raises(registry.BackendUnavailable, match="'cpu' cannot move these planes: planes on \\['meta'\\]"):
        registry.select_backend(meta, "meta", "cpu")


def test_plugins_are_loaded_by_name_and_failures_isolated(monkeypatch, native_cpu):
    with_plugins(
        monkeypatch,
        **{"meta-fast": "tests.kernels.plugin_backends:MetaBackend",
           "broken": "tests.kernels.plugin_backends:BrokenAtImport",
           "missing": "tests.kernels.no_such_module:Backend"},
    )
    rows = {row["name"]: row for row in registry.describe_backends()}
    assert rows["meta-fast"]["available"] is True
    assert rows["broken"] == {"name": "broken", "available": False,
                              "reason": "plugin tests.kernels.plugin_backends:BrokenAtImport failed to load: "
                                        "driver missing"}
    assert rows["missing"]["available"] is False
    assert "No module named 'tests.kernels.no_such_module'" in rows["missing"]["reason"]
    assert rows["cpu"]["available"] is True
    assert registry.select_backend(cpu_planes(), "meta").name == "meta-fast"
    assert registry.select_backend(cpu_planes(), "cpu").name == "cpu"
    with pytest.raises(registry.BackendUnavailable, match="'broken' is unavailable: plugin"):
        registry.select_backend(cpu_planes(), "cpu", "broken")


def test_a_builtin_that_fails_to_import_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(registry.BUILTIN_MODULES, "cpu", "lmcache_platforms.kernels.no_such_backend")
    rows = {row["name"]: row for row in registry.describe_backends()}
    assert rows["cpu"]["available"] is False
    assert rows["cpu"]["reason"].startswith("cannot import lmcache_platforms.kernels.no_such_backend")
    assert registry.select_backend(cpu_planes(), "cpu").name == "torch"


def test_each_platform_prefers_its_native_backend_and_others_the_torch_one() -> None:
    assert {name: registry.preferred_backend(name) for name in PLATFORM_NAMES} == {
        "npu": "ascend", "xpu": "triton", "cuda": "triton", "cpu": "cpu"}
    assert registry.preferred_backend("mps") == "torch"
