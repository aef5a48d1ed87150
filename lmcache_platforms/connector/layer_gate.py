"""Per-layer hand-over between vLLM's forward and a transfer running beside it (the layerwise mode).

A store follows the forward: the forward marks each layer once its KV is written (``save_kv_layer``) and the
store copies the layers as they are marked, whatever their order. A load runs ahead of the forward: the loader
marks each layer once its rows are written (or queued on the load stream) and the forward waits for exactly that
layer (``wait_for_layer_load``). On a device each mark carries an event, recorded on the stream that did the work,
which the other side's stream waits on; on CPU the mark alone is the hand-over. ``release`` ends the gate: every
wait returns and every layer not yet marked counts as ready (the forward is over, or the load gave up and its
rows are reported failed, so nothing reads them as loaded).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Collection, Iterator, Sequence
from typing import Any

from lmcache_platforms.kernels.contract import TransferError


class LayerGate:
    """Which layers are ready, each with the event that makes them so on a device (None on CPU)."""

    def __init__(self, layers: Collection[str]) -> None:
        self.layers = frozenset(layers)
        self._ready = threading.Condition()
        self._marked: dict[str, Any] = {}
        self._released = False
        self._passes = 0

    def mark(self, layer: str, event: Any = None) -> None:
        with self._ready:
            self._marked[layer] = event
            self._ready.notify_all()

    def release(self) -> None:
        with self._ready:
            self._released = True
            self._ready.notify_all()

    @property
    def released(self) -> bool:
        return self._released

    def begin_pass(self) -> None:
        """A load fills the gate in one pass: a second pass would mark layers the first already let the forward
        read while the second's rows are not written yet."""
        with self._ready:
            self._passes += 1
            if self._passes > 1:
                raise TransferError("a layerwise load moves all its chunks in one batched call; got a second call")

    def wait(self, layer: str, deadline: float = float("inf")) -> tuple[bool, Any]:
        """Until ``layer`` is marked or the gate released: (whether either happened before ``deadline``, the
        layer's event or None). A layer the gate does not cover is ready at once."""
        if layer not in self.layers:
            return True, None
        with self._ready:
            while layer not in self._marked and not self._released:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False, None
                self._ready.wait(None if left == float("inf") else left)
            return True, self._marked.get(layer)

    def as_marked(self, layers: Sequence[str]) -> Iterator[tuple[str, Any]]:
        """Each of ``layers`` once, as soon as it is marked (the first in ``layers`` when several are), the rest in
        order once the gate is released; with the layer's event or None."""
        pending = list(layers)
        while pending:
            with self._ready:
                ready = [name for name in pending if name in self._marked]
                while not ready and not self._released:
                    self._ready.wait()
                    ready = [name for name in pending if name in self._marked]
                chosen = ready[0] if ready else pending[0]
                event = self._marked.get(chosen)
            pending.remove(chosen)
            yield chosen, event
