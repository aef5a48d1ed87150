"""Which platform this process runs on: ``LMCACHE_PLATFORMS_DEVICE`` if set, else the first available of
npu, xpu, cuda, cpu. Platform modules are imported by name only when asked for."""

from __future__ import annotations

import functools
import importlib
import os

from lmcache_platforms.platforms.base import Platform

PLATFORM_NAMES = ("npu", "xpu", "cuda", "cpu")
DEVICE_ENV = "LMCACHE_PLATFORMS_DEVICE"


class PlatformError(RuntimeError):
    """The requested platform is unknown or unusable here."""


def load_platform(name: str) -> Platform:
    """The platform object of module ``lmcache_platforms.platforms.<name>``."""
    if name not in PLATFORM_NAMES:
        raise PlatformError(f"unknown platform {name!r}; known: {', '.join(PLATFORM_NAMES)}")
    return importlib.import_module(f"lmcache_platforms.platforms.{name}").PLATFORM


def describe_platforms() -> list[dict[str, object]]:
    """Every known platform with its availability, for ``doctor``."""
    out = []
    for name in PLATFORM_NAMES:
        try:
            out.append(load_platform(name).describe())
        except Exception as exc:  # noqa: BLE001 - a broken runtime module must not hide the others
            out.append({"name": name, "available": False, "reason": f"{type(exc).__name__}: {exc}"})
    return out


@functools.cache
def current_platform() -> Platform:
    """The platform chosen for this process (cached; the override must name an available one)."""
    forced = os.environ.get(DEVICE_ENV, "").strip().lower()
    if forced:
        platform = load_platform(forced)
        ok, reason = platform.available()
        if not ok:
            raise PlatformError(f"{DEVICE_ENV}={forced} but that platform is unavailable: {reason}")
        return platform
    for name in PLATFORM_NAMES:
        try:
            platform = load_platform(name)
        except ImportError:
            continue
        if platform.available()[0]:
            return platform
    return load_platform("cpu")
