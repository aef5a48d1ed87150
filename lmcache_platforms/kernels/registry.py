"""Finds kernel backends by name and picks the fastest one that can move a transfer group on its device.

Built-in backends are modules exposing ``BACKEND``, imported only when first asked for (Triton and the
Ascend runtime are heavy or absent). Third-party backends come from the entry-point group
``lmcache_platforms.kernel_backends`` (the entry's name is the backend's name; it loads a KernelBackend
instance or a class building one). A backend that fails to import is reported unavailable with the error,
never fatal to the others.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from importlib.metadata import entry_points

import torch

from lmcache_platforms.kernels.contract import KernelBackend
from lmcache_platforms.kernels.stripe_hashing import DeviceStripeHasher
from lmcache_platforms.layout.plane import Plane
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

ENTRY_POINT_GROUP = "lmcache_platforms.kernel_backends"
BUILTIN_MODULES: dict[str, str] = {
    "torch": "lmcache_platforms.kernels.torch_backend",
    "cpu": "lmcache_platforms.kernels.cpu_backend",
    "triton": "lmcache_platforms.kernels.triton_backend",
    "ascend": "lmcache_platforms.kernels.ascend_backend",
}
# Fastest first; `torch` always ends the list as the fallback. The one place a platform's kernels are chosen.
AUTO_ORDER: dict[str, tuple[str, ...]] = {
    "cpu": ("cpu", "torch"),
    "cuda": ("triton", "torch"),
    "xpu": ("triton", "torch"),
    "npu": ("ascend", "torch"),
}


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot be used here (named, with the reason)."""


class _Unloadable(KernelBackend):
    """Stands in for a backend whose module or entry point failed to load."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self._reason = reason

    def availability(self) -> tuple[bool, str]:
        return False, self._reason

    def transfer(self, planes, slots, buffer, direction) -> None:
        raise BackendUnavailable(f"kernel backend {self.name!r} is unavailable: {self._reason}")


_loaded: dict[str, KernelBackend] = {}
_lock = threading.Lock()


def _plugin_entries() -> dict:
    try:
        return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}
    except Exception as exc:  # noqa: BLE001 - broken package metadata must not break the built-in backends
        logger.warning("cannot list %s entry points: %s", ENTRY_POINT_GROUP, exc)
        return {}


def backend_names() -> list[str]:
    """Every backend name known here: built-ins first, then installed plugins."""
    return [*BUILTIN_MODULES, *(n for n in _plugin_entries() if n not in BUILTIN_MODULES)]


def _load(name: str) -> KernelBackend:
    if name in BUILTIN_MODULES:
        try:
            return importlib.import_module(BUILTIN_MODULES[name]).BACKEND
        except Exception as exc:  # noqa: BLE001 - isolate one backend's import failure
            return _Unloadable(name, f"cannot import {BUILTIN_MODULES[name]}: {exc}")
    entry = _plugin_entries().get(name)
    if entry is None:
        raise BackendUnavailable(f"unknown kernel backend {name!r}; known: {', '.join(backend_names())}")
    try:
        loaded = entry.load()
        backend = loaded() if isinstance(loaded, type) else loaded
    except Exception as exc:  # noqa: BLE001 - a plugin must not take the process down
        logger.warning("kernel backend plugin %r (%s) failed to load: %s", name, entry.value, exc)
        return _Unloadable(name, f"plugin {entry.value} failed to load: {exc}")
    if not isinstance(backend, KernelBackend):
        return _Unloadable(name, f"plugin {entry.value} gave {type(backend).__name__}, not a KernelBackend")
    return backend


def get_backend(name: str) -> KernelBackend:
    """The backend called ``name`` (loaded once); unavailable ones are returned too, ask ``availability``."""
    with _lock:
        if name not in _loaded:
            _loaded[name] = _load(name)
        return _loaded[name]


def describe_backends() -> list[dict]:
    """``{name, available, reason}`` for every known backend, for ``doctor``."""
    rows = []
    for name in backend_names():
        available, reason = get_backend(name).availability()
        rows.append({"name": name, "available": available, "reason": reason})
    return rows


def preferred_backend(device_type: str) -> str:
    """The built-in backend ``auto`` tries first on ``device_type`` (doctor reports it per platform)."""
    return AUTO_ORDER.get(device_type, ("torch",))[0]


def _candidates(device_type: str) -> list[str]:
    plugins = [
        n for n in backend_names()
        if n not in BUILTIN_MODULES and device_type in getattr(get_backend(n), "device_types", ())
    ]
    return [*plugins, *AUTO_ORDER.get(device_type, ("torch",))]


def select_backend(
    planes: Sequence[Plane], device: torch.device | str, preference: str = "auto"
) -> KernelBackend:
    """The backend to move ``planes`` on ``device``.

    ``auto``: the fastest available one that supports the planes (plugins declaring the device type in
    ``device_types`` first, then the built-in order), else ``torch``. A named preference is used as is or
    refused with BackendUnavailable saying why.
    """
    # A string, not torch.device: "npu" only parses once torch_npu is imported.
    device_type = device.split(":")[0] if isinstance(device, str) else device.type
    if preference != "auto":
        backend = get_backend(preference)
        available, reason = backend.availability()
        if not available:
            raise BackendUnavailable(f"kernel backend {preference!r} is unavailable: {reason}")
        unsupported = backend.unsupported(planes)
        if unsupported:
            raise BackendUnavailable(f"kernel backend {preference!r} cannot move these planes: {unsupported}")
        return backend
    for name in _candidates(device_type):
        backend = get_backend(name)
        available, reason = backend.availability()
        if not available:
            logger.debug("kernel backend %r skipped on %s: %s", name, device_type, reason)
            continue
        unsupported = backend.unsupported(planes)
        if unsupported is None:
            return backend
        logger.debug("kernel backend %r skipped on %s: %s", name, device_type, unsupported)
    return get_backend("torch")


def device_hasher(platform: str, device: torch.device) -> DeviceStripeHasher | None:
    """What makes the stripe CRCs of objects staged on ``device`` (memory of ``platform``, a platform name) there,
    or None: the host hashes them. Triton's CRC-32C where it runs, once it was built and run there and agreed with
    the native CRC-32C; where it runs but does not agree, a warning says why and the host hashes."""
    from lmcache_platforms.kernels import triton_crc32c

    if not triton_crc32c.usable(platform, device):
        return None
    problem = triton_crc32c.self_check(device)
    if problem is not None:
        logger.warning("chunk checksums are computed on the host, not on %s: %s", device, problem)
        return None
    return triton_crc32c
