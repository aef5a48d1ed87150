"""Third-party-style backends loaded through real entry points in the registry tests."""

from __future__ import annotations

from lmcache_platforms.kernels.torch_backend import TorchBackend


class MetaBackend(TorchBackend):
    """Claims the `meta` device type, so `auto` must prefer it there."""

    name = "meta-fast"
    device_types = ("meta",)


class BrokenAtImport:
    def __init__(self) -> None:
        raise RuntimeError("driver missing")
