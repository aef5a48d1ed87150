"""NVIDIA CUDA: torch.cuda streams and events."""

from __future__ import annotations

import torch

from lmcache_platforms.platforms.base import Platform


class CudaPlatform(Platform):
    name = "cuda"
    torch_module_name = "cuda"

    def available(self) -> tuple[bool, str]:
        if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
            return False, f"torch {torch.__version__} is not a CUDA/ROCm build"
        if not torch.cuda.is_available():
            return False, "no CUDA device visible"
        return True, f"{torch.cuda.device_count()} CUDA device(s)"


PLATFORM = CudaPlatform()
