"""Intel XPU: torch.xpu streams and events.

torch >= 2.5 has ``torch.xpu`` built in. Older stacks get it from Intel Extension for PyTorch, which is
imported only when torch lacks it, so IPEX stays optional. LMCache's own XPU device layer works on its
torch baseline, so no device plugin is needed.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

import torch

from lmcache_platforms.platforms.base import Platform

IPEX = "intel_extension_for_pytorch"


class XpuPlatform(Platform):
    name = "xpu"
    torch_module_name = "xpu"

    def _module(self) -> Any:
        if not hasattr(torch, "xpu") and importlib.util.find_spec(IPEX) is not None:
            importlib.import_module(IPEX)
        return torch.xpu

    def available(self) -> tuple[bool, str]:
        try:
            xpu = self._module()
        except AttributeError:
            return False, f"torch {torch.__version__} has no torch.xpu and {IPEX} is not installed"
        except Exception as exc:  # noqa: BLE001 - a broken IPEX/oneAPI install must read as "unavailable"
            return False, f"{IPEX} failed to import: {type(exc).__name__}: {exc}"
        if not xpu.is_available():
            return False, "no Intel XPU visible"
        return True, f"{xpu.device_count()} Intel XPU(s): {xpu.get_device_name()}"


PLATFORM = XpuPlatform()
