"""NpuPlatform against a thin fake of torch_npu (a module that adds ``torch.npu`` when imported, as the real
one does), and our LMCache NPU device spec against LMCache's real NPU classes."""

from __future__ import annotations

import importlib.machinery
import sys
import types

import pytest
import torch

from lmcache_platforms.platforms import npu as npu_platform
from tests.platforms.fake_runtime import FakeDeviceRuntime, FakeEvent, FakeStream

NPU = npu_platform.NpuPlatform()


RUNTIME: FakeDeviceRuntime | None = None


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """Installs an importable ``torch_npu`` whose import sets ``torch.npu``; returns a setter for the fake."""
    (tmp_path / "torch_npu.py").write_text(
        "import torch\nfrom tests.platforms import test_npu\n"
        "if test_npu.RUNTIME is None:\n    raise RuntimeError('libascendcl.so: cannot open shared object file')\n"
        "torch.npu = test_npu.RUNTIME\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))

    def install(runtime: FakeDeviceRuntime | None) -> FakeDeviceRuntime | None:
        monkeypatch.setattr(sys.modules[__name__], "RUNTIME", runtime)
        return runtime

    yield install
    sys.modules.pop("torch_npu", None)
    if hasattr(torch, "npu"):
        del torch.npu


def test_unavailable_without_torch_npu():
    assert NPU.available() == (False, "torch_npu is not installed")


def test_broken_torch_npu_reads_unavailable_with_the_reason(fake_torch_npu):
    fake_torch_npu(None)
    assert NPU.available() == (
        False, "torch_npu failed to import: RuntimeError: libascendcl.so: cannot open shared object file")


def test_no_visible_device(fake_torch_npu):
    fake_torch_npu(FakeDeviceRuntime(0, ""))
    assert NPU.available() == (False, "torch_npu is installed but no Ascend NPU is visible")


def test_available_and_310p_detection(fake_torch_npu):
    fake_torch_npu(FakeDeviceRuntime(2, "Ascend310P3"))
    assert NPU.available() == (True, "2 Ascend NPU(s): Ascend310P3")
    assert NPU.is_310p()
    fake_torch_npu(FakeDeviceRuntime(8, "Ascend910B1"))
    sys.modules.pop("torch_npu")
    assert not NPU.is_310p()


def test_streams_events_and_sync_go_to_torch_npu(fake_torch_npu):
    runtime = fake_torch_npu(FakeDeviceRuntime(1, "Ascend910B1"))
    stream = NPU.new_stream()
    assert isinstance(stream, FakeStream)
    assert NPU.current_stream() is runtime.default_stream
    event = NPU.new_event()
    assert isinstance(event, FakeEvent)
    with NPU.stream_context(stream):
        assert NPU.current_stream() is stream
        event.record()
    with NPU.stream_context(None):
        pass
    NPU.synchronize()
    assert runtime.log == [("enter", stream.name), ("record", event.name, stream.name), ("exit", stream.name),
                           ("synchronize",)]
    assert runtime.entered == [stream.name]
    assert runtime.synchronized == 1


def test_defaults():
    assert (NPU.name, NPU.torch_module_name, NPU.default_kernel_backend) == ("npu", "npu", "ascend")
    assert npu_platform.PLATFORM.name == "npu"


def test_device_plugin_names_the_backend_our_platform_selects():
    import lmcache_platforms_npu_device as plugin

    assert plugin.LMCACHE_BACKEND_NAME == npu_platform.LMCACHE_BACKEND_NAME == NPU.lmcache_device_backend


def test_upstream_npu_ops_need_lmcache_ascend_ours_do_not():
    from lmcache.v1.platform.devices.npu.device_ops import NpuDeviceOps

    from lmcache_platforms_npu_device import PlatformsNpuDeviceOps

    with pytest.raises(ImportError, match=r"lmcache_ascend\.ops"):
        NpuDeviceOps().ensure_native()
    ops = PlatformsNpuDeviceOps()
    ops.ensure_native()
    assert ops.device_type == "npu"


def test_our_ops_bind_lmcache_ascend_native_ops_when_installed(monkeypatch):
    from lmcache_platforms_npu_device import PlatformsNpuDeviceOps

    package = types.ModuleType("lmcache_ascend")
    package.__path__ = []
    native = types.ModuleType("lmcache_ascend.ops")
    native.__spec__ = importlib.machinery.ModuleSpec("lmcache_ascend.ops", None)
    package.__spec__ = importlib.machinery.ModuleSpec("lmcache_ascend", None)

    def multi_layer_kv_transfer(*args):
        return "native"

    native.multi_layer_kv_transfer = multi_layer_kv_transfer
    monkeypatch.setitem(sys.modules, "lmcache_ascend", package)
    monkeypatch.setitem(sys.modules, "lmcache_ascend.ops", native)
    ops = PlatformsNpuDeviceOps()
    ops.ensure_native()
    assert ops.multi_layer_kv_transfer() == "native"


def test_lmcache_selects_our_spec_by_backend_name(fake_torch_npu, monkeypatch):
    """Both NPU specs registered (upstream's and ours): LMCache picks ours when LMCACHE_DEVICE_BACKEND names it,
    and its ops build without LMCache-Ascend."""
    import lmcache.v1.platform as lmcache_platform
    from lmcache.v1.platform.devices.npu import NpuDeviceSpec

    fake_torch_npu(FakeDeviceRuntime(1, "Ascend910B1"))
    import torch_npu  # noqa: F401 - adds torch.npu, as on a real host

    from lmcache_platforms_npu_device import PlatformsNpuDeviceSpec

    ours, upstream = PlatformsNpuDeviceSpec(), NpuDeviceSpec()
    assert (ours.device_type, ours.backend_name, ours.torch_module_name) == ("npu", "lmcache_platforms_npu", "npu")
    monkeypatch.setattr(lmcache_platform, "_DEVICE_TYPE_REGISTRY", {"npu": (upstream, ours)})
    monkeypatch.setattr(lmcache_platform, "_DEVICE_REGISTRY", {"npu": upstream, "lmcache_platforms_npu": ours})
    monkeypatch.delenv("LMCACHE_DEVICE_BACKEND", raising=False)
    with pytest.raises(RuntimeError, match="LMCACHE_DEVICE_BACKEND"):
        lmcache_platform.resolve_device_ops("npu")
    monkeypatch.setenv("LMCACHE_DEVICE_BACKEND", npu_platform.LMCACHE_BACKEND_NAME)
    assert type(lmcache_platform.resolve_device_ops("npu")).__name__ == "PlatformsNpuDeviceOps"
