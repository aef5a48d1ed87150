"""LMCache's NPU device layer without LMCache-Ascend, published through the ``lmcache.device_plugins`` entry
point as ``lmcache_platforms_npu``.

Upstream's ``NpuDeviceSpec`` refuses to build its ops without LMCache-Ascend's ``lmcache_ascend.ops``, so on
a plain vllm-ascend install ``import lmcache`` ends with no ``device_ops`` at all. This spec is upstream's
with ops that bind LMCache-Ascend's native module when it is installed and otherwise stay on LMCache's torch
baseline; our connector moves KV data with its own kernels, so nothing here needs LMCache-Ascend.
We do not provide a module named ``lmcache_ascend.ops``: it would shadow a real LMCache-Ascend install and
claim a native surface we do not have. Two NPU specs are then registered, so LMCache needs
``LMCACHE_DEVICE_BACKEND=lmcache_platforms_npu`` (the NPU image sets it).

Importing this module imports LMCache; only LMCache's plugin discovery and ``NpuPlatform`` load it. It lives
outside the ``lmcache_platforms`` package on purpose: LMCache imports every device plugin whenever it is imported,
and importing a module inside our package activates the package, which would patch every process that imports
LMCache (LMCache's own server among them), whether or not it runs our connector.
"""

from __future__ import annotations

import importlib
import importlib.util

from lmcache.v1.platform.base.device_ops import DeviceOps
from lmcache.v1.platform.devices.npu import NpuDeviceSpec
from lmcache.v1.platform.devices.npu.device_ops import NpuDeviceOps

# Must equal lmcache_platforms.platforms.npu.LMCACHE_BACKEND_NAME (tested); not imported, for the reason above.
LMCACHE_BACKEND_NAME = "lmcache_platforms_npu"
ASCEND_NATIVE_OPS = "lmcache_ascend.ops"


def ascend_native_ops_installed() -> bool:
    """True when LMCache-Ascend's compiled ops module can be found (looked up, not imported)."""
    try:
        return importlib.util.find_spec(ASCEND_NATIVE_OPS) is not None
    except ModuleNotFoundError:
        return False


class PlatformsNpuDeviceOps(NpuDeviceOps):
    """Upstream's NPU ops; native LMCache-Ascend kernels when installed, LMCache's torch baseline otherwise."""

    def ensure_native(self) -> None:
        if self._native_bound:  # type: ignore[has-type]
            return
        self._native_bound = True
        if ascend_native_ops_installed():
            self.bind_native(importlib.import_module(ASCEND_NATIVE_OPS))


class PlatformsNpuDeviceSpec(NpuDeviceSpec):
    """Upstream's NPU spec under our backend name, with ops that do not require LMCache-Ascend."""

    @property
    def backend_name(self) -> str:
        return LMCACHE_BACKEND_NAME

    @property
    def ops_cls(self) -> type[DeviceOps]:
        return PlatformsNpuDeviceOps
