"""A checksum in every chunk object we store, so a same-size corruption in any tier is never loaded as KV.

LMCache 0.5.6's objects carry none: a remote value overwritten with bytes of the right length used to load as
a hit. Each object (a chunk, a chunk part, a layerwise step) ends its payload with an 8-byte trailer, the
checksum (little-endian) and a 4-byte mark, inside the padding the chunk format has anyway (``chunk_format``
makes room for it). The store writes it once the rows are in host memory; a load checks every object of the
batch before the first byte is written into the KV cache.

The checksum is the CRC-32 (``zlib.crc32``) of the list of CRC-32s of the payload's 1 MiB stripes, so the
stripes of a batch are hashed on as many threads as the kernels use (zlib releases the GIL). It was the fastest
check at hand (one thread, this machine: crc32 4.3 GB/s, adler32 3.6, sha1 1.9, blake2b 0.9), and it always
catches a single flipped byte: the stripe's CRC changes, then the CRC over the stripe CRCs (a change within one
32-bit word). It is no defence against forged objects, which the key space does not protect against either.
"""

from __future__ import annotations

import functools
import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

TRAILER_BYTES = 8
# Part of every chunk format's fingerprint: objects without (or with another) trailer live under other keys.
FORMAT_VERSION = "crc32-stripes-1MiB-trailer-v1"
STRIPE_BYTES = 1 << 20
_MARK = b"LMCk"
_TRAILER = struct.Struct("<I4s")


@functools.cache
def _pool(pid: int, workers: int) -> ThreadPoolExecutor:
    """Threads of this process (a forked child must not reuse its parent's, which do not exist in it)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="lmcp-checksum")


def _payload(flat: torch.Tensor, payload_bytes: int) -> Any:
    """The payload as a host array (a MemoryObj is host memory except on rare device-resident paths)."""
    part = flat[:payload_bytes]
    return (part if part.device.type == "cpu" else part.cpu()).numpy()


def _crcs(pieces: Sequence[Any]) -> list[int]:
    return [zlib.crc32(piece) for piece in pieces]


def checksums(flats: Sequence[torch.Tensor], payload_bytes: int) -> list[int]:
    """The checksum of the first ``payload_bytes`` of each flat uint8 tensor."""
    arrays = [_payload(flat, payload_bytes) for flat in flats]
    owners, pieces = [], []
    for index, array in enumerate(arrays):
        for start in range(0, max(payload_bytes, 1), STRIPE_BYTES):
            owners.append(index)
            pieces.append(array[start : start + STRIPE_BYTES])
    workers = min(torch.get_num_threads(), len(pieces))
    if workers <= 1:
        stripe_crcs = _crcs(pieces)
    else:
        share = -(-len(pieces) // workers)
        groups = [pieces[i : i + share] for i in range(0, len(pieces), share)]
        stripe_crcs = [crc for group in _pool(os.getpid(), workers).map(_crcs, groups) for crc in group]
    per_object: list[list[int]] = [[] for _ in arrays]
    for owner, crc in zip(owners, stripe_crcs, strict=True):
        per_object[owner].append(crc)
    return [zlib.crc32(struct.pack(f"<{len(crcs)}I", *crcs)) for crcs in per_object]


def trailer(checksum: int) -> bytes:
    """The trailer bytes for ``checksum``."""
    return _TRAILER.pack(checksum, _MARK)


def seal(flats: Sequence[torch.Tensor], payload_bytes: int) -> None:
    """Write each object's trailer right after its payload (the objects' bytes must be final)."""
    for flat, checksum in zip(flats, checksums(flats, payload_bytes), strict=True):
        data = torch.frombuffer(bytearray(trailer(checksum)), dtype=torch.uint8)
        flat[payload_bytes : payload_bytes + TRAILER_BYTES].copy_(data)


def mismatched(flats: Sequence[torch.Tensor], payload_bytes: int) -> list[int]:
    """Indices of the objects whose trailer does not match their payload (a missing trailer never does)."""
    expected = checksums(flats, payload_bytes)
    out = []
    for index, (flat, checksum) in enumerate(zip(flats, expected, strict=True)):
        stored = flat[payload_bytes : payload_bytes + TRAILER_BYTES]
        if bytes((stored if stored.device.type == "cpu" else stored.cpu()).numpy()) != trailer(checksum):
            out.append(index)
    return out
