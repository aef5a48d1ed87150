"""A thin stand-in for an accelerator's ``torch.<device>`` module (``torch.npu``, ``torch.xpu``): the part the
platform modules use, recording what was called. Only for runtimes this machine cannot have."""

from __future__ import annotations

import contextlib


class FakeDeviceRuntime:
    def __init__(self, count: int, name: str, current: int = 0) -> None:
        self.count, self.name, self.current = count, name, current
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
        return self.current

    def current_stream(self) -> FakeDeviceRuntime.Stream:
        return self.default_stream

    @contextlib.contextmanager
    def stream(self, stream):
        self.entered.append(stream)
        yield

    def synchronize(self) -> None:
        self.synchronized += 1
