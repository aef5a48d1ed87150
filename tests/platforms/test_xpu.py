"""XpuPlatform against a thin fake of the ``torch.xpu`` runtime, and the IPEX path for torch builds that
lack ``torch.xpu`` (a fake IPEX module that adds it when imported, as IPEX does)."""

from __future__ import annotations

import sys

import torch

from lmcache_platforms.platforms import xpu as xpu_platform
from tests.platforms.fake_runtime import FakeDeviceRuntime, FakeEvent, FakeStream

XPU = xpu_platform.XpuPlatform()


IPEX_RUNTIME: FakeDeviceRuntime | None = None


def test_unavailable_on_this_cpu_build():
    assert XPU.available() == (False, "no Intel XPU visible")


def test_available_streams_events_and_sync(monkeypatch):
    runtime = FakeDeviceRuntime(2, "Intel(R) Data Center GPU Max 1550", current=1)
    monkeypatch.setattr(torch, "xpu", runtime)
    assert XPU.available() == (True, "2 Intel XPU(s): Intel(R) Data Center GPU Max 1550")
    assert XPU.device() == torch.device("xpu", 1)
    assert XPU.device(0) == torch.device("xpu", 0)
    stream = XPU.new_stream()
    assert isinstance(stream, FakeStream) and stream is not runtime.default_stream
    assert XPU.current_stream() is runtime.default_stream
    event = XPU.new_event()
    assert isinstance(event, FakeEvent)
    with XPU.stream_context(stream):
        assert XPU.current_stream() is stream
        event.record()
    with XPU.stream_context(None):
        assert XPU.current_stream() is runtime.default_stream
    XPU.current_stream().wait_event(event)
    XPU.synchronize()
    assert runtime.log == [("enter", stream.name), ("record", event.name, stream.name), ("exit", stream.name),
                           ("wait_event", "default", event.name), ("synchronize",)]
    assert (runtime.entered, runtime.synchronized) == ([stream.name], 1)


def test_ipex_supplies_torch_xpu_when_torch_lacks_it(tmp_path, monkeypatch):
    (tmp_path / f"{xpu_platform.IPEX}.py").write_text(
        "import torch\nfrom tests.platforms import test_xpu\ntorch.xpu = test_xpu.IPEX_RUNTIME\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "IPEX_RUNTIME", FakeDeviceRuntime(1, "Intel(R) Arc(TM) A770", current=1))
    monkeypatch.delattr(torch, "xpu")
    try:
        assert XPU.available() == (True, "1 Intel XPU(s): Intel(R) Arc(TM) A770")
    finally:
        sys.modules.pop(xpu_platform.IPEX, None)


def test_no_torch_xpu_and_no_ipex(monkeypatch):
    monkeypatch.delattr(torch, "xpu")
    assert XPU.available() == (
        False, f"torch {torch.__version__} has no torch.xpu and intel_extension_for_pytorch is not installed")


def test_defaults_and_no_lmcache_plugin():
    assert (XPU.name, XPU.torch_module_name, XPU.default_kernel_backend) == ("xpu", "xpu", "triton")
    assert XPU.lmcache_device_backend is None
