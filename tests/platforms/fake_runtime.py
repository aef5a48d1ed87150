"""A thin stand-in for an accelerator's ``torch.<device>`` module (``torch.npu``, ``torch.xpu``): the part the
platform modules use, recording what was called. Only for runtimes this machine cannot have.

It records, it does not emulate: streams and events only append to ``log`` (``stream(s)`` also makes ``s``
the current stream, as the real context manager does, so code asking for the current stream sees it).
``watching`` adds what torch itself ran while a stream was current: every in-place write (kernels,
``copy_``) to a tensor the caller names, every other op reading one (views aside), and every pinned
allocation (served from ordinary memory: this CPU build of torch has no pinned allocator); and each seal of
stored objects, which the native library writes outside torch. Nothing is
delayed or reordered, so a test reads the log as the order in which a real device was asked to do things.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lmcache_platforms.connector import checksum

Entry = tuple[Any, ...]
Tagger = Callable[[torch.Tensor], str | None]


class FakeStream:
    """A stream that logs what is asked of it; ``name`` is ``default`` or ``stream<N>`` in creation order."""

    def __init__(self, runtime: FakeDeviceRuntime, name: str | None = None) -> None:
        self.runtime = runtime
        self.name = name or f"stream{next(runtime._stream_ids)}"

    def wait_stream(self, other: FakeStream) -> None:
        self.runtime.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.runtime.log.append(("wait_event", self.name, event.name))

    def record_event(self, event: FakeEvent | None = None) -> FakeEvent:
        event = event or FakeEvent(self.runtime)
        event.record(self)
        return event

    def synchronize(self) -> None:
        self.runtime.log.append(("stream_synchronize", self.name))

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"FakeStream({self.name})"


class FakeEvent:
    """An event that logs where it was recorded and who waited for it."""

    def __init__(self, runtime: FakeDeviceRuntime, *args: Any, **kwargs: Any) -> None:
        self.runtime = runtime
        self.name = f"event{next(runtime._event_ids)}"

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.runtime.current_stream()
        self.runtime.log.append(("record", self.name, stream.name))

    def wait(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.runtime.current_stream()
        self.runtime.log.append(("wait_event", stream.name, self.name))

    def synchronize(self) -> None:
        self.runtime.log.append(("event_synchronize", self.name))

    def query(self) -> bool:
        return True


class FakeDeviceRuntime:
    """``torch.xpu`` / ``torch.npu`` as far as the platforms use it; ``log`` holds every call, in order."""

    def __init__(self, count: int, name: str, current: int = 0) -> None:
        self.count, self.name, self.current = count, name, current
        self.log: list[Entry] = []
        self._stream_ids = itertools.count(1)
        self._event_ids = itertools.count(1)
        self.default_stream = FakeStream(self, "default")
        self._current: list[FakeStream] = [self.default_stream]

    def Stream(self, *args: Any, **kwargs: Any) -> FakeStream:
        return FakeStream(self)

    def Event(self, *args: Any, **kwargs: Any) -> FakeEvent:
        return FakeEvent(self)

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_name(self) -> str:
        return self.name

    def current_device(self) -> int:
        return self.current

    def current_stream(self) -> FakeStream:
        return self._current[-1]

    @property
    def entered(self) -> list[str]:
        """Names of the streams entered through ``stream(...)``, in order."""
        return [entry[1] for entry in self.log if entry[0] == "enter"]

    @property
    def synchronized(self) -> int:
        """How many times the whole device was synchronized."""
        return sum(1 for entry in self.log if entry[0] == "synchronize")

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        self.log.append(("enter", stream.name))
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()
            self.log.append(("exit", stream.name))

    def synchronize(self) -> None:
        self.log.append(("synchronize",))

    @contextlib.contextmanager
    def watching(self, tag: Tagger) -> Iterator[None]:
        """Also log torch's in-place writes to tensors ``tag`` names, pinned allocations (see the module), and
        each seal of stored objects as ``("seal", stream, objects)``: the native library writes their stripe
        tables and trailers at their addresses, which no torch dispatch sees."""
        sealing = checksum.seal

        def seal(flats: Any, payload_bytes: int, stripes: Any = None) -> None:
            self.log.append(("seal", self.current_stream().name, len(flats)))
            sealing(flats, payload_bytes, stripes)

        with _Watcher(self, tag), mock.patch.object(checksum, "seal", seal):
            yield


def _written_and_read(func: Any, args: tuple, kwargs: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Tensors an aten op writes (its mutable arguments) and the other tensor arguments it reads."""
    written, read = [], []
    for index, arg in enumerate(func._schema.arguments):
        value = kwargs.get(arg.name) if arg.kwarg_only or index >= len(args) else args[index]
        tensors = [value] if isinstance(value, torch.Tensor) else [
            v for v in value if isinstance(v, torch.Tensor)] if isinstance(value, (list, tuple)) else []
        is_write = arg.alias_info is not None and arg.alias_info.is_write
        (written if is_write else read).extend(tensors)
    return written, read


class _Watcher(TorchDispatchMode):
    def __init__(self, runtime: FakeDeviceRuntime, tag: Tagger) -> None:
        super().__init__()
        self.runtime, self.tag = runtime, tag

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        stream = self.runtime.current_stream().name
        if func is torch.ops.aten._pin_memory.default:
            self.runtime.log.append(("pin", stream, tuple(args[0].shape), args[0].dtype))
            return args[0].clone()
        if kwargs.get("pin_memory"):
            self.runtime.log.append(("pinned_alloc", stream, func.__name__, kwargs.get("dtype")))
            kwargs["pin_memory"] = False
        written, read = _written_and_read(func, args, kwargs)
        targets = [name for name in map(self.tag, written) if name]
        sources = tuple(dict.fromkeys(name for name in map(self.tag, read) if name))
        op = func.overloadpacket.__name__
        if targets:
            non_blocking = bool(kwargs.get("non_blocking", len(args) > 2 and args[2] is True))
            self.runtime.log.append(("write", stream, op, targets[0], sources, non_blocking))
        elif sources and not any(ret.alias_info for ret in func._schema.returns):  # views read nothing yet
            self.runtime.log.append(("read", stream, op, sources))
        return func(*args, **kwargs)
