"""The checksum in every chunk object we store, so a same-size corruption in any tier is never loaded as KV: the
object format and the functions that hash, seal and open objects. Which of them a binding uses, and when a load
decides, is ``connector.integrity``'s choice.

LMCache 0.5.6's objects carry none: a remote value overwritten with bytes of the right length used to load as
a hit. Each object (a chunk, a chunk part, a layerwise step) follows its payload with the table of its 64 KiB
stripes' CRC-32Cs (4 bytes each, little-endian) and an 8-byte trailer, the checksum and a 4-byte mark, inside
the padding the chunk format has anyway (``chunk_format`` makes room with ``tail_bytes``). The checksum is the
CRC-32C of the table. A load takes the table only when its CRC matches the trailer.

The stripe CRCs come from the kernels that copy the bytes (``object_stripes``: states they feed), from the
device (``kernels.triton_crc32c``, the same values, so only the short list of stripe CRCs crosses to the host),
or from a pass over host memory (``stripe_crcs``): the native CPU library (``kernels.crc32c``: a carry-less fold
with AVX-512 or AVX2 and VPCLMULQDQ, or the CRC-32C instruction of x86-64 or aarch64 on three stripes at once)
on as many threads as the kernels use. It was chosen by measurement (``lmcache-platforms bench --layout``; one
thread on the CI machine: zlib's CRC-32 4.3 GB/s, adler32 3.6, sha1 1.9, blake2b 0.9, the instruction about
20). Without the native library the stripes' CRC-32 (``zlib.crc32``, which releases the GIL too) stands in, under
another format version: the two never read each other's objects. Either way a single flipped byte is always
caught: its stripe's CRC changes, then the CRC over the stripe CRCs (a change within one 32-bit word). It is no
defence against forged objects, which the key space does not protect against either.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import zlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.kernels.crc32c import (
    TRAILER_BYTES,
    NativeCrc32c,
    ObjectCheck,
    ObjectStripes,
    native,
    table_stripes,
)

STRIPE_BYTES = 64 << 10
_MARK = b"LMCk"
_TRAILER = struct.Struct("<I4s")
_MARK_WORD = int.from_bytes(_MARK, "little")  # the mark as the native seal and check take it


class ChecksumMismatch(TransferError):
    """A stored chunk object's bytes do not match the checksum written with them."""


def stripes_are_crc32c() -> bool:
    """Whether stripes are hashed with CRC-32C (the native library is built), which the GPU kernel computes too."""
    return native() is not None


def hashing() -> str:
    """How this process hashes stripes on the host (``doctor`` says it: it decides what a checksum costs)."""
    lib = native()
    if lib is None:
        return ("zlib's CRC-32: the native library is not built, so checksums are slower and objects are not "
                "shared with servers that have it")
    way = (f"a {lib.folding}-bit carry-less fold" if lib.folding else
           "the CRC-32C instruction" if lib.hardware else "a table")
    return f"CRC-32C in native code, {way}"


def format_version() -> str:
    """Part of every chunk format's fingerprint: objects with another (or no) checksum live under other keys."""
    return f"{'crc32c' if native() is not None else 'crc32'}-stripes-{STRIPE_BYTES}-table-trailer-v2"


def stripe_room(payload_bytes: int, objects: int) -> torch.Tensor | None:
    """Room for the stripe CRC-32Cs of ``objects`` objects that a hashing store fills (``object_stripes``), or
    None where stripes are not CRC-32C (no native library) or the objects have no payload (no copy to hash
    in): ``checksums`` then hashes the objects afterwards."""
    if native() is None or payload_bytes == 0:
        return None
    return torch.empty((objects, stripe_count(payload_bytes)), dtype=torch.int32)


def object_stripes(payload_bytes: int, objects: int = 1) -> list[ObjectStripes]:
    """Empty stripe states for ``objects`` objects of ``payload_bytes``, which a hashing store fills as it
    copies (one allocation for all of them)."""
    lib = native()
    if lib is None:
        raise RuntimeError("stripe states need the native CRC-32C, which this process does not have")
    return lib.stripe_states(payload_bytes, STRIPE_BYTES, objects)


@functools.cache
def _pool(pid: int, workers: int) -> ThreadPoolExecutor:
    """Threads of this process (a forked child must not reuse its parent's, which do not exist in it)."""
    return ThreadPoolExecutor(workers, thread_name_prefix="lmcp-checksum")


def _host(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` in host memory (a MemoryObj is, except on rare device-resident paths)."""
    return (flat if flat.device.type == "cpu" else flat.cpu()).contiguous()


def _addressable(flat: torch.Tensor) -> bool:
    """Whether ``flat`` is a contiguous 1-D uint8 tensor in host memory, whose bytes ctypes reads and writes at
    its address: a few microseconds where tensor slicing and copies cost several times that per object."""
    return flat.is_cpu and flat.dtype is torch.uint8 and flat.ndim == 1 and flat.is_contiguous()


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


def stripe_count(payload_bytes: int) -> int:
    """Stripes of a ``payload_bytes`` payload (at least one)."""
    return table_stripes(payload_bytes, STRIPE_BYTES)


def tail_bytes(payload_bytes: int) -> int:
    """Bytes an object needs after its payload: the stripe table, then the trailer."""
    return 4 * stripe_count(payload_bytes) + TRAILER_BYTES


def stripe_crcs(flats: Sequence[torch.Tensor], payload_bytes: int) -> torch.Tensor:
    """The stripe CRCs (``[objects, stripes]`` int32) of the first ``payload_bytes`` of each flat uint8 tensor,
    hashed from memory on the kernels' thread count."""
    lib = native()
    hosts = [_host(flat) for flat in flats]
    count = stripe_count(payload_bytes)
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

    if not hosts:
        return crcs
    workers = min(torch.get_num_threads(), len(hosts) * count)
    shares = _runs(len(hosts), count, max(workers, 1))
    if len(shares) == 1:
        work(shares[0])
    else:
        list(_pool(os.getpid(), len(shares)).map(work, shares))
    return crcs


def _given(stripes: torch.Tensor) -> torch.Tensor:
    if native() is None:
        raise RuntimeError("stripe CRC-32Cs were given but this process hashes stripes with zlib's CRC-32")
    return stripes.contiguous()


def _of_table(table: torch.Tensor) -> int:
    """The object checksum: the CRC of its stripe table (one object's row of stripe CRCs)."""
    lib = native()
    if lib is not None:
        return lib.crc(table.data_ptr(), 4 * table.numel())
    data: Any = table.numpy()  # zlib reads it through the buffer protocol
    return zlib.crc32(data)


def checksums(flats: Sequence[torch.Tensor], payload_bytes: int, stripes: torch.Tensor | None = None) -> list[int]:
    """The checksum of the first ``payload_bytes`` of each flat uint8 tensor; ``stripes``: their stripe CRC-32Cs
    (``[objects, stripes]`` int32, host memory) where the store's kernels or the device computed them already."""
    rows = _given(stripes) if stripes is not None else stripe_crcs(flats, payload_bytes)
    return [_of_table(row) for row in rows]


def trailer(checksum: int) -> bytes:
    """The trailer bytes for ``checksum``."""
    return _TRAILER.pack(checksum, _MARK)


def seal(flats: Sequence[torch.Tensor], payload_bytes: int, stripes: torch.Tensor | None = None) -> None:
    """Write each object's stripe table and trailer right after its payload (the objects' bytes must be final;
    ``stripes`` as for ``checksums``)."""
    rows = _given(stripes) if stripes is not None else stripe_crcs(flats, payload_bytes)
    if len(rows) != len(flats):
        raise ValueError(f"{len(flats)} objects to seal, stripe CRCs for {len(rows)}")
    table = 4 * rows.shape[-1]
    for flat in flats:
        if flat.numel() * flat.element_size() < payload_bytes + table + TRAILER_BYTES:
            raise ValueError(f"an object of {flat.numel() * flat.element_size()} bytes has no room after its "
                             f"{payload_bytes}-byte payload for the {table}-byte stripe table and the trailer")
    lib = native()
    if lib is not None and all(map(_addressable, flats)):  # LMCache's objects: one native call for them all
        lib.seal_all(flats, payload_bytes, rows, _MARK_WORD)
        return
    for flat, row in zip(flats, rows, strict=True):
        mark = torch.frombuffer(bytearray(trailer(_of_table(row))), dtype=torch.uint8)
        tail = torch.cat([row.view(torch.uint8), mark])
        flat[payload_bytes : payload_bytes + tail.numel()].copy_(tail)


def stored_stripes(flat: torch.Tensor, payload_bytes: int) -> torch.Tensor | None:
    """The stripe CRCs an object carries (int32, host), or None when its table does not match its trailer (or
    it has none): what a load checks each stripe against before writing its bytes (``ObjectCheck``)."""
    table = 4 * stripe_count(payload_bytes)
    end = payload_bytes + table + TRAILER_BYTES
    if _addressable(flat):
        if flat.numel() < end:
            return None
        tail = ctypes.string_at(flat.data_ptr() + payload_bytes, table + TRAILER_BYTES)
    else:
        tail = bytes(_host(flat[payload_bytes:end]).numpy())
    if len(tail) != table + TRAILER_BYTES:
        return None
    stripes = torch.frombuffer(bytearray(tail[:table]), dtype=torch.int32)
    return stripes if tail[table:] == trailer(_of_table(stripes)) else None


def _native_over(flats: Sequence[torch.Tensor], load: str) -> NativeCrc32c:
    """The native CRC-32C a ``load`` reading each object's table at its address needs, the objects checked: each a
    contiguous 1-D uint8 tensor in host memory (LMCache's are)."""
    lib = native()
    if lib is None:
        raise RuntimeError(f"a {load} load needs the native CRC-32C, which this process does not have")
    for flat in flats:
        if not _addressable(flat):
            raise ValueError(f"a {load} load needs its object as a contiguous 1-D uint8 tensor in host memory, "
                             f"got {tuple(flat.shape)} {flat.dtype} on {flat.device}")
    return lib


def object_checks(flats: Sequence[torch.Tensor], payload_bytes: int) -> list[ObjectCheck | None]:
    """A load's stripe-by-stripe check of each host object against the CRCs it carries, or None where its table
    does not match its trailer (the object is corrupt, or has none)."""
    return _native_over(flats, "checked").open_objects(flats, payload_bytes, STRIPE_BYTES, _MARK_WORD)


def object_check(flat: torch.Tensor, payload_bytes: int) -> ObjectCheck | None:
    """``object_checks`` of one object."""
    return object_checks([flat], payload_bytes)[0]


def carried_tables(flats: Sequence[torch.Tensor], payload_bytes: int) -> torch.Tensor | None:
    """The stripe CRCs the host objects carry, read in one native call (``NativeCrc32c.open_tables``), for
    ``unverified``; None when any object's table does not match its trailer."""
    room, opened = _native_over(flats, "hashed").open_tables(flats, payload_bytes, STRIPE_BYTES, _MARK_WORD)
    return room if all(opened) else None


def unverified(hashing: Sequence[ObjectStripes], tables: torch.Tensor) -> list[int]:
    """Indices of the objects whose stripes a load hashed as it copied (``hashing``, from ``object_stripes``)
    differ from those they carry (``carried_tables``): one native call for them all."""
    lib = native()
    assert lib is not None, "object_stripes made the states, so the native CRC-32C is there"
    return lib.verify(hashing, tables)


def carried_stripes(flats: Sequence[torch.Tensor], payload_bytes: int) -> list[torch.Tensor | None]:
    """The stripe CRCs each object carries, or None where its table does not match its trailer: what a load
    compares with the CRCs the device computed (``differing``)."""
    if native() is not None and all(map(_addressable, flats)):
        return [check.expected if check is not None else None for check in object_checks(flats, payload_bytes)]
    return [stored_stripes(flat, payload_bytes) for flat in flats]


def differing(carried: Sequence[torch.Tensor | None], stripes: torch.Tensor) -> list[int]:
    """Indices of the objects whose stripe CRCs (``stripes``, ``[objects, stripes]`` int32 in host memory)
    differ from those they carry (``carried_stripes``)."""
    return [index for index, (table, row) in enumerate(zip(carried, stripes, strict=True))
            if table is None or not torch.equal(table, row)]


def mismatched(flats: Sequence[torch.Tensor], payload_bytes: int) -> list[int]:
    """Indices of the objects whose stripe table or trailer does not match their payload (a missing trailer
    never does), hashed from memory. Reads each table with ``stored_stripes``, not ``object_checks``, which
    ``bench --engine --checksum-cost`` times as a call of its own."""
    carried = [stored_stripes(flat, payload_bytes) for flat in flats]
    return differing(carried, stripe_crcs(flats, payload_bytes))
