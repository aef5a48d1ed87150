"""Store and load each run on their own stream of the platform, so offloading overlaps the forward pass.

On CPU the platform has no streams and everything here is a no-op: transfers run synchronously.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from lmcache_platforms.platforms.base import Platform
from lmcache_platforms.platforms.detect import PLATFORM_NAMES, load_platform


def platform_for(device: torch.device) -> Platform:
    """The platform owning ``device``'s memory (the plain CPU one for cpu and unknown device types)."""
    return load_platform(device.type if device.type in PLATFORM_NAMES else "cpu")


class TransferStreams:
    """One stream per direction; stores wait for the forward's writes, loads finish before returning. Beside
    each, a side stream for work that only reads what its direction staged (the device's stripe CRCs), so it
    runs while the direction's own stream copies across the bus."""

    def __init__(self, platform: Platform) -> None:
        self.platform = platform
        self.store_stream = platform.new_stream()
        self.load_stream = platform.new_stream()
        self._sides = {"store": platform.new_stream(), "load": platform.new_stream()}

    def side(self, stream: Any) -> Any:
        """The side stream of ``stream`` (the store or load stream)."""
        if stream is self.store_stream:
            return self._sides["store"]
        if stream is self.load_stream:
            return self._sides["load"]
        raise ValueError(f"{stream!r} is neither this binding's store stream nor its load stream")

    @contextlib.contextmanager
    def beside(self, stream: Any) -> Iterator[None]:
        """Run the body on the side stream of ``stream`` (the store or load stream), after everything ``stream``
        queued so far; what ``stream`` queues next does not wait for it (``rejoin``, ``wait_side``)."""
        side = self.side(stream) if stream is not None else None
        if side is not None:
            side.wait_stream(stream)
        with self.platform.stream_context(side):
            yield

    def rejoin(self, stream: Any) -> None:
        """Make ``stream`` wait for what its side stream queued (before it overwrites what the side reads)."""
        if stream is not None:
            stream.wait_stream(self.side(stream))

    def wait_side(self, stream: Any) -> None:
        """Block until what the side stream of ``stream`` queued is done (its results may be read on the host)."""
        if stream is not None:
            self.side(stream).synchronize()

    @contextlib.contextmanager
    def storing(self) -> Iterator[None]:
        """Run the body on the store stream, after everything the compute stream has queued so far."""
        if self.store_stream is not None:
            self.store_stream.wait_stream(self.platform.current_stream())
        with self.platform.stream_context(self.store_stream):
            yield

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        with self.platform.stream_context(self.load_stream):
            yield

    def forward_event(self) -> Any:
        """An event recorded now on the forward's stream (a layer's KV written), None on CPU."""
        if self.store_stream is None:
            return None
        event = self.platform.new_event()
        event.record(self.platform.current_stream())
        return event

    def store_after(self, event: Any) -> None:
        """Make the store stream wait for ``event`` (``forward_event``) before what it queues next."""
        if event is not None and self.store_stream is not None:
            self.store_stream.wait_event(event)

    def load_event(self) -> Any:
        """An event recorded now on the load stream (a layer's rows queued), None on CPU."""
        if self.load_stream is None:
            return None
        event = self.platform.new_event()
        event.record(self.load_stream)
        return event

    def compute_after(self, event: Any) -> None:
        """Make the forward's stream wait for ``event`` (``load_event``)."""
        if event is not None:
            self.platform.current_stream().wait_event(event)

    def finish_store(self) -> None:
        """Block until stored bytes are in host memory: LMCache hands the MemoryObjs to storage next."""
        if self.store_stream is not None:
            self.store_stream.synchronize()

    def wait_loads(self) -> None:
        """Block until what the load stream queued so far is done (its bytes may be read on the host)."""
        if self.load_stream is not None:
            self.load_stream.synchronize()

    def mark_loaded(self) -> None:
        """Make the compute stream wait for what the load stream queued (one layer, or everything)."""
        self.compute_after(self.load_event())

    def finish_load(self) -> None:
        """Block until loads are done: LMCache frees or reuses the source MemoryObjs right after."""
        if self.load_stream is not None:
            self.mark_loaded()
            self.wait_loads()


class Scratch:
    """A device buffer reused by ONE direction; store and load each own one, so they can never race."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._buffer: torch.Tensor | None = None

    def get(self, nbytes: int) -> torch.Tensor:
        if self._buffer is None or self._buffer.numel() < nbytes:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffer[:nbytes]
