"""XpuPlatform against a thin fake of the ``torch.xpu`` runtime, and the IPEX path for torch builds that
lack ``torch.xpu`` (a fake IPEX module that adds it when imported, as IPEX does)."""

from __future__ import annotations

import contextlib
import sys

import torch

from lmcache_platforms.platforms import xpu as xpu_platform

XPU = xpu_platform.XpuPlatform()


class FakeXpuRuntime:
    """The part of ``torch.xpu`` the platform uses, recording what was called."""

    def __init__(self, count: int = 2, name: str = "Intel(R) Data Center GPU Max 1550") -> None:
        self.count, self.name = count, name
        self.entered: list[object] = []
        self.synchronized = 0
        self.default_stream = self.Stream()

    class Stream:
        pass

    class Event:
        pass

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_name(self) -> str:
        return self.name

    def current_device(self) -> int:
        return 1

    def current_stream(self) -> FakeXpuRuntime.Stream:
        return self.default_stream

    @contextlib.contextmanager
    def stream(self, stream):
        self.entered.append(stream)
        yield

    def synchronize(self) -> None:
        self.synchronized += 1


IPEX_RUNTIME: FakeXpuRuntime | None = None


def test_unavailable_on_this_cpu_build():
    assert XPU.available() == (False, "no Intel XPU visible")


def test_available_streams_events_and_sync(monkeypatch):
    runtime = FakeXpuRuntime()
    monkeypatch.setattr(torch, "xpu", runtime)
    assert XPU.available() == (True, "2 Intel XPU(s): Intel(R) Data Center GPU Max 1550")
    assert XPU.device() == torch.device("xpu", 1)
    assert XPU.device(0) == torch.device("xpu", 0)
    stream = XPU.new_stream()
    assert isinstance(stream, FakeXpuRuntime.Stream)
    assert XPU.current_stream() is runtime.default_stream
    assert isinstance(XPU.new_event(), FakeXpuRuntime.Event)
    with XPU.stream_context(stream):
        pass
    XPU.synchronize()
    assert (runtime.entered, runtime.synchronized) == ([stream], 1)


def test_ipex_supplies_torch_xpu_when_torch_lacks_it(tmp_path, monkeypatch):
    (tmp_path / f"{xpu_platform.IPEX}.py").write_text(
        "import torch\nfrom tests.platforms import test_xpu\ntorch.xpu = test_xpu.IPEX_RUNTIME\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "IPEX_RUNTIME", FakeXpuRuntime(1, "Intel(R) Arc(TM) A770"))
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
    assert XPU.lmcache_device_spec() is None
