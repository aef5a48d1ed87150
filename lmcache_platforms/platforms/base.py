"""What the connector needs from an accelerator: device, streams, events, pinned host memory, default kernels.

Each platform module (cpu, cuda, xpu, npu) subclasses ``Platform`` and overrides only what differs. Runtime
modules (torch_npu, IPEX) are imported lazily inside methods so this package imports on any machine.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


class Platform:
    """Defaults are the synchronous CPU behaviour; accelerator platforms override them."""

    name: str = "cpu"
    torch_module_name: str = ""
    default_kernel_backend: str = "torch"
    #: ``backend_name`` of the DeviceSpec we add for this platform, selected through LMCACHE_DEVICE_BACKEND
    lmcache_device_backend: str | None = None

    def available(self) -> tuple[bool, str]:
        """(usable on this machine, why or why not)."""
        return True, "always available"

    def device(self, index: int | None = None) -> torch.device:
        if not self.torch_module_name:
            return torch.device("cpu")
        return torch.device(self.torch_module_name, self._module().current_device() if index is None else index)

    def _module(self) -> Any:
        """The ``torch.<name>`` runtime module (``torch.cuda``, ``torch.xpu``, ``torch.npu``)."""
        return getattr(torch, self.torch_module_name)

    def current_stream(self) -> Any:
        return self._module().current_stream() if self.torch_module_name else None

    def new_stream(self) -> Any:
        return self._module().Stream() if self.torch_module_name else None

    @contextlib.contextmanager
    def stream_context(self, stream: Any) -> Iterator[None]:
        """Run the body on ``stream`` (no-op on CPU or for a None stream)."""
        if stream is None or not self.torch_module_name:
            yield
            return
        with self._module().stream(stream):
            yield

    def new_event(self) -> Any:
        return self._module().Event() if self.torch_module_name else None

    def synchronize(self) -> None:
        if self.torch_module_name:
            self._module().synchronize()

    def empty_pinned(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Host memory the device can copy from asynchronously (plain memory on CPU)."""
        return torch.empty(shape, dtype=dtype, pin_memory=bool(self.torch_module_name))

    def pin_memory(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.torch_module_name else tensor

    def describe(self) -> dict[str, Any]:
        ok, reason = self.available()
        return {"name": self.name, "available": ok, "reason": reason,
                "default_kernel_backend": self.default_kernel_backend}
