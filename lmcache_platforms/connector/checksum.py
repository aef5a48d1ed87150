"""A checksum in every chunk object we store, so a same-size corruption in any tier is never loaded as KV.

LMCache 0.5.6's objects carry none: a remote value overwritten with bytes of the right length used to load as
a hit. Each object (a chunk, a chunk part, a layerwise step) ends its payload with an 8-byte trailer, the
CRC-32 of the payload (``zlib.crc32``, little-endian) and a 4-byte mark, inside the padding the chunk format
has anyway (``chunk_format`` makes room for it). The store writes it once the rows are in host memory; a load
checks every object of the batch before the first byte is written into the KV cache.

CRC-32 because it was the fastest check at hand (4.3 GB/s on the CI machine against blake2b 0.9, sha1 1.9,
adler32 3.6; it releases the GIL) and a single flipped bit or burst is always caught; it is no defence
against someone forging objects, which the key space does not protect against either.
"""

from __future__ import annotations

import struct
import zlib

import torch

TRAILER_BYTES = 8
# Part of every chunk format's fingerprint: objects without (or with another) trailer live under other keys.
FORMAT_VERSION = "crc32-trailer-v1"
_MARK = b"LMCk"
_TRAILER = struct.Struct("<I4s")


def _host_bytes(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` readable from the CPU (a MemoryObj is host memory except on rare device-resident paths)."""
    return flat if flat.device.type == "cpu" else flat.cpu()


def payload_checksum(flat: torch.Tensor, payload_bytes: int) -> int:
    """CRC-32 of the first ``payload_bytes`` of a flat uint8 tensor."""
    return zlib.crc32(_host_bytes(flat[:payload_bytes]).numpy())


def trailer(checksum: int) -> bytes:
    """The trailer bytes for ``checksum``."""
    return _TRAILER.pack(checksum, _MARK)


def seal(flat: torch.Tensor, payload_bytes: int) -> None:
    """Write the payload's trailer right after it (the object's bytes must be final)."""
    data = torch.frombuffer(bytearray(trailer(payload_checksum(flat, payload_bytes))), dtype=torch.uint8)
    flat[payload_bytes : payload_bytes + TRAILER_BYTES].copy_(data)


def intact(flat: torch.Tensor, payload_bytes: int) -> bool:
    """Whether the object's trailer matches its payload (a missing or damaged trailer does not)."""
    stored = bytes(_host_bytes(flat[payload_bytes : payload_bytes + TRAILER_BYTES]).numpy())
    return stored == trailer(payload_checksum(flat, payload_bytes))
