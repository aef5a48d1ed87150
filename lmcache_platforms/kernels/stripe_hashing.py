"""What a kernel backend's checksummed copies are given, beside the transfer contract: a stripe hasher fed as a
store copies an object's payload, and a stripe check a load consults as it copies. The contract names these
protocols, not one CRC implementation; the native CRC-32C (``kernels.crc32c``) implements both, and a backend that
hashes in native code reads the addresses of their state in host memory. A device that hashes staged objects
itself does so through a ``DeviceStripeHasher``, which the kernel registry chooses (``registry.device_hasher``)."""

from __future__ import annotations

from typing import Protocol

import torch


class StripeSink(Protocol):
    """An object's stripe checksums being built from its payload's bytes, in any order, each byte once."""

    payload_bytes: int
    stripe: int
    registers_address: int  # the stripes' running CRC registers, host memory
    lengths_address: int  # the stripes' byte counts so far, host memory

    def feed(self, data: torch.Tensor, offset: int) -> None: ...

    def finish(self, out: torch.Tensor) -> None: ...


class StripeCheck(Protocol):
    """A load's check of one object against the stripe checksums it carries, each stripe checked once."""

    payload_bytes: int
    stripe: int
    address: int  # the object's payload, host memory
    expected_address: int  # the stripes' expected checksums, host memory
    state_address: int  # which stripes matched so far, host memory

    def check(self, start: int, end: int) -> bool: ...


class DeviceStripeHasher(Protocol):
    """Stripe CRCs of objects staged in device memory, made there (Triton's CRC-32C: ``kernels.triton_crc32c``)."""

    def aligned(self, payload_bytes: int) -> bool: ...

    def stripe_crcs(self, buffer: torch.Tensor, objects: int, object_bytes: int,
                    payload_bytes: int) -> torch.Tensor: ...
