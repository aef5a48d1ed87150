"""A checksum in every chunk object we store, so a same-size corruption in any tier is never loaded as KV.

LMCache 0.5.6's objects carry none: a remote value overwritten with bytes of the right length used to load as
a hit. Each object (a chunk, a chunk part, a layerwise step) ends its payload with an 8-byte trailer, the
checksum (little-endian) and a 4-byte mark, inside the padding the chunk format has anyway (``chunk_format``
makes room for it). The store writes it once the rows are in host memory; a load checks every object before a
byte of it is written into the KV cache (``LayoutBinding.load_verified`` says in which order).

The checksum is the CRC-32C of the list of CRC-32Cs of the payload's 64 KiB stripes. A whole-chunk store into
host objects gets the stripe CRCs from its kernels, which hash each byte as they copy it (``stripe_room``,
``object_stripes``, ``KernelBackend.store_hashed``): no second pass over the object. Otherwise (a load's
check, a layer-by-layer store) the native CPU library hashes the objects (``kernels.crc32c``: an AVX-512
carry-less fold, or the crc32 instruction on three stripes at once) on as many threads as the kernels use; for
chunks the connector stages on a GPU a Triton kernel hashes them there (``kernels.triton_crc32c``, the same
values), so only the short list of stripe CRCs crosses to the host. It was chosen by measurement
(``lmcache-platforms bench --layout``; one thread on the CI machine: zlib's CRC-32 4.3 GB/s, adler32 3.6, sha1 1.9,
blake2b 0.9, the instruction about 20). Without the native library the stripes' CRC-32 (``zlib.crc32``, which
releases the GIL too) stands in, under another format version: the two never read each other's objects. Either
way a single flipped byte is always caught: its stripe's CRC changes, then the CRC over the stripe CRCs (a change
within one 32-bit word). It is no defence against forged objects, which the key space does not protect against
either.
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

from lmcache_platforms.kernels.crc32c import ObjectStripes, native

TRAILER_BYTES = 8
STRIPE_BYTES = 64 << 10
_MARK = b"LMCk"
_TRAILER = struct.Struct("<I4s")


def stripes_are_crc32c() -> bool:
    """Whether stripes are hashed with CRC-32C (the native library is built), which the GPU kernel computes too."""
    return native() is not None


def format_version() -> str:
    """Part of every chunk format's fingerprint: objects with another (or no) checksum live under other keys."""
    return f"{'crc32c' if native() is not None else 'crc32'}-stripes-{STRIPE_BYTES}-trailer-v1"


def stripe_room(payload_bytes: int, objects: int) -> torch.Tensor | None:
    """Room for the stripe CRC-32Cs of ``objects`` objects that a hashing store fills (``object_stripes``), or
    None where stripes are not CRC-32C (no native library: ``checksums`` hashes the objects afterwards)."""
    if native() is None:
        return None
    return torch.empty((objects, max(1, -(-payload_bytes // STRIPE_BYTES))), dtype=torch.int32)


def object_stripes(payload_bytes: int) -> ObjectStripes:
    """An empty stripe state for one object of ``payload_bytes``, which a hashing store fills as it copies."""
    lib = native()
    if lib is None:
        raise RuntimeError("stripe states need the native CRC-32C, which this process does not have")
    return lib.object_stripes(payload_bytes, STRIPE_BYTES)


@functools.cache
def _pool(pid: int, workers: int) -> ThreadPoolExecutor:
    """Threads of this process (a forked child must not reuse its parent's, which do not exist in it)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="lmcp-checksum")


def _host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` in host memory (a MemoryObj is, except on rare device-resident paths)."""
    return (flat if flat.device.type == "cpu" else flat.cpu()).contiguous()


def _runs(objects: int, count: int, workers: int) -> list[list[tuple[int, int, int]]]:
    """``objects`` x ``count`` stripes cut into ``workers`` near-equal shares of (object, first, last) runs."""
    total = objects * count
    share = -(-total // workers)
    out = []
    for begin in range(0, total, share):
        stop, runs = min(begin + share, total), []
        while begin < stop:
            index, first = divmod(begin, count)
            last = min(count, first + stop - begin)
            runs.append((index, first, last))
            begin += last - first
        out.append(runs)
    return out


def checksums(flats: Sequence[torch.Tensor], payload_bytes: int, stripes: torch.Tensor | None = None) -> list[int]:
    """The checksum of the first ``payload_bytes`` of each flat uint8 tensor; ``stripes``: their stripe CRC-32Cs
    (``[objects, stripes]`` int32, host memory) where the device computed them already."""
    lib = native()
    if stripes is not None:
        if lib is None:
            raise RuntimeError("stripe CRC-32Cs were given but this process hashes stripes with zlib's CRC-32")
        return [lib.crc(row.data_ptr(), 4 * row.numel()) for row in stripes.contiguous()]
    hosts = [_host(flat) for flat in flats]
    count = max(1, -(-payload_bytes // STRIPE_BYTES))
    crcs = torch.empty((len(hosts), count), dtype=torch.int32)

    def work(runs: list[tuple[int, int, int]]) -> None:
        for index, first, last in runs:
            if lib is not None:
                lib.stripes(hosts[index].data_ptr(), payload_bytes, STRIPE_BYTES, first, last,
                            crcs[index].data_ptr() + 4 * first)
                continue
            data: Any = hosts[index][:payload_bytes].numpy()  # zlib reads it through the buffer protocol
            crcs[index].numpy().view("<u4")[first:last] = [
                zlib.crc32(data[k * STRIPE_BYTES : (k + 1) * STRIPE_BYTES]) for k in range(first, last)]

    workers = min(torch.get_num_threads(), len(hosts) * count)
    shares = _runs(len(hosts), count, max(workers, 1))
    if len(shares) == 1:
        work(shares[0])
    else:
        list(_pool(os.getpid(), len(shares)).map(work, shares))
    if lib is not None:
        return [lib.crc(row.data_ptr(), 4 * count) for row in crcs]
    return [zlib.crc32(row.numpy()) for row in crcs]


def trailer(checksum: int) -> bytes:
    """The trailer bytes for ``checksum``."""
    return _TRAILER.pack(checksum, _MARK)


def seal(flats: Sequence[torch.Tensor], payload_bytes: int, stripes: torch.Tensor | None = None) -> None:
    """Write each object's trailer right after its payload (the objects' bytes must be final; ``stripes`` as for
    ``checksums``)."""
    for flat, checksum in zip(flats, checksums(flats, payload_bytes, stripes), strict=True):
        data = torch.frombuffer(bytearray(trailer(checksum)), dtype=torch.uint8)
        flat[payload_bytes : payload_bytes + TRAILER_BYTES].copy_(data)


def mismatched(flats: Sequence[torch.Tensor], payload_bytes: int, stripes: torch.Tensor | None = None) -> list[int]:
    """Indices of the objects whose trailer does not match their payload (a missing trailer never does;
    ``stripes`` as for ``checksums``)."""
    expected = checksums(flats, payload_bytes, stripes)
    out = []
    for index, (flat, checksum) in enumerate(zip(flats, expected, strict=True)):
        stored = _host(flat[payload_bytes : payload_bytes + TRAILER_BYTES])
        if bytes(stored.numpy()) != trailer(checksum):
            out.append(index)
    return out
