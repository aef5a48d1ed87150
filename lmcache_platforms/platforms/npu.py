"""Ascend NPU: torch_npu streams and events.

torch_npu is imported on first use (it adds ``torch.npu``), never at module import, so this module loads on
any machine. LMCache's own NPU backend needs LMCache-Ascend's native ops; without them LMCache gets its NPU
device layer from our ``lmcache_platforms_npu`` device plugin (top-level module ``lmcache_platforms_npu_device``),
which LMCache finds through its entry point and selects by ``LMCACHE_BACKEND_NAME``: this module names it and
never imports it (the plugin imports LMCache; platforms import nothing above them).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from lmcache_platforms.platforms.base import Platform

LMCACHE_BACKEND_NAME = "lmcache_platforms_npu"


class NpuPlatform(Platform):
    name = "npu"
    torch_module_name = "npu"
    lmcache_device_backend = LMCACHE_BACKEND_NAME

    def _module(self) -> Any:
        importlib.import_module("torch_npu")
        return torch.npu  # type: ignore[attr-defined]

    def available(self) -> tuple[bool, str]:
        if importlib.util.find_spec("torch_npu") is None:
            return False, "torch_npu is not installed"
        try:
            npu = self._module()
        except Exception as exc:  # noqa: BLE001 - a broken CANN install must read as "unavailable", with why
            return False, f"torch_npu failed to import: {type(exc).__name__}: {exc}"
        if not npu.is_available():
            return False, "torch_npu is installed but no Ascend NPU is visible"
        return True, f"{npu.device_count()} Ascend NPU(s): {self.soc_name()}"

    def soc_name(self) -> str:
        """The chip's name as torch_npu reports it, e.g. ``Ascend910B1`` or ``Ascend310P3``."""
        return str(self._module().get_device_name())



PLATFORM = NpuPlatform()
