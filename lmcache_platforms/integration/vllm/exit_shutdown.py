"""Shuts every live engine impl down before Python joins threads at interpreter exit.

At exit Python joins non-daemon threads before any atexit handler (vLLM's engine finalizer included) runs, so
LMCache's threads kept a one-process vLLM from ever exiting; threading's own pre-join hook runs first. The impl
registers itself, whatever connector wraps it: vLLM's ``LMCacheConnectorV1`` never calls its impl's shutdown.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Protocol


class ShutsDown(Protocol):
    role_name: str

    def shutdown(self) -> Any: ...


_live: weakref.WeakSet[Any] = weakref.WeakSet()
_lock = threading.Lock()
_registered = False


def _shut_down_all() -> None:
    """Workers before schedulers: a scheduler's lookup client terminates LMCache's shared ZMQ context,
    which blocks for ever while a worker's offload server still holds a socket on it."""
    for impl in sorted(_live, key=lambda i: i.role_name != "worker"):
        impl.shutdown()


def shut_down_at_exit(impl: ShutsDown) -> None:
    """Shut ``impl`` down at interpreter exit unless something did before (its shutdown is idempotent)."""
    global _registered
    _live.add(impl)
    with _lock:
        if _registered:
            return
        # AttributeError: no such hook in this Python; RuntimeError: the interpreter is already exiting.
        with contextlib.suppress(AttributeError, RuntimeError):
            threading._register_atexit(_shut_down_all)  # type: ignore[attr-defined]
            _registered = True
