"""CRC-32C of buffer stripes in the native CPU library (``csrc/cpu/crc32c.c``), for the chunk checksum.

A carry-less fold on x86-64 CPUs with AVX-512 and VPCLMULQDQ (inside a hashing store's or load's copies, a
256-bit fold with AVX2 and VPCLMULQDQ, a 128-bit one on any x86-64 CPU with PCLMULQDQ), the CRC-32C instruction
(x86-64 SSE 4.2, aarch64's CRC extension) on three stripes at once otherwise, a table elsewhere: the same values
every way. ctypes releases the GIL for the call, so several Python threads hash stripes in parallel.
``ObjectStripes`` builds one object's stripe CRCs from pieces in any order: what the CPU backend's hashing store
and load (``cpu_backend.CpuBackend.store_hashed``, ``load_hashed``) write into as they copy; ``ObjectCheck`` is a
layer-by-layer load's check of an object stripe by stripe against the CRCs it carries
(``cpu_backend.CpuBackend.load_checked``).
``native()`` is None when the library was not built, or is a build from before these functions (then rebuild
it).
"""

from __future__ import annotations

import array
import ctypes
import functools
from collections.abc import Sequence

import torch

from lmcache_platforms.kernels.native_library import REBUILD_HINT, load_library
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)


# After an object's stripe table: the table's CRC-32C and a 4-byte mark (what lmcp_crc32c_open_all reads).
TRAILER_BYTES = 8


def table_stripes(payload_bytes: int, stripe: int) -> int:
    """Entries of an object's stripe table: one per stripe, and one for an empty payload."""
    return max(1, -(-payload_bytes // stripe))


class NativeCrc32c:
    """The library's CRC-32C entry points, argument types set."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._one = lib.lmcp_crc32c
        self._one.argtypes, self._one.restype = [vp, i64], ctypes.c_uint32
        self._stripes = lib.lmcp_crc32c_stripes
        self._stripes.argtypes, self._stripes.restype = [vp, i64, i64, i64, i64, vp], None
        self._portable = lib.lmcp_crc32c_portable
        self._portable.argtypes, self._portable.restype = [vp, i64], ctypes.c_uint32
        self.hardware = bool(lib.lmcp_crc32c_hardware())
        self._accumulate = lib.lmcp_crc32c_accumulate
        self._accumulate.argtypes, self._accumulate.restype = [vp, i64, i64, i64, i64, vp, vp], ctypes.c_int
        self._finish = lib.lmcp_crc32c_finish
        self._finish.argtypes, self._finish.restype = [i64, i64, vp, vp, vp], ctypes.c_int
        self._allow_vectors = lib.lmcp_crc32c_allow_vectors
        self._allow_vectors.argtypes, self._allow_vectors.restype = [ctypes.c_int], ctypes.c_int
        self._folding = lib.lmcp_crc32c_folding
        self._check = lib.lmcp_crc32c_check
        self._check.argtypes, self._check.restype = [vp, i64, i64, vp, vp, i64, i64], ctypes.c_int
        self._seal_all = lib.lmcp_crc32c_seal_all
        self._seal_all.argtypes, self._seal_all.restype = [vp, i64, i64, i64, vp, ctypes.c_uint32], None
        self._open_all = lib.lmcp_crc32c_open_all
        self._open_all.argtypes = [vp, vp, i64, i64, i64, ctypes.c_uint32, vp, vp]
        self._open_all.restype = None
        self._verify_all = lib.lmcp_crc32c_verify_all
        self._verify_all.argtypes = [i64, i64, i64, vp, vp, vp, i64, vp]
        self._verify_all.restype = i64

    @property
    def folding(self) -> int:
        """The carry-less fold's width in use: 512 (AVX-512 with VPCLMULQDQ), 256 (AVX2 with VPCLMULQDQ), 128
        (PCLMULQDQ), 0 (none)."""
        return int(self._folding())

    def allow_vectors(self, widest: int) -> int:
        """Caps the fold's width (512, 256, 128, 0: the crc32 instruction or the table), so tests run every path this
        CPU has; returns the previous cap."""
        return int(self._allow_vectors(widest))

    def accumulate(self, address: int, nbytes: int, offset: int, stripe: int, payload_bytes: int, registers: int,
                   lengths: int) -> int:
        """Adds the ``nbytes`` at ``address`` (payload offset ``offset``, in any order) to the stripe state at
        ``registers`` / ``lengths``; 0, or -1 when they overrun a stripe."""
        return int(self._accumulate(address, nbytes, offset, stripe, payload_bytes, registers, lengths))

    def finish(self, payload_bytes: int, stripe: int, registers: int, lengths: int, out: int) -> int:
        """The stripes' CRC-32Cs from their state into uint32s at ``out``; 0, or -1 when a stripe's bytes did
        not all come exactly once."""
        return int(self._finish(payload_bytes, stripe, registers, lengths, out))

    def check(self, address: int, payload_bytes: int, stripe: int, expected: int, state: int, start: int,
              end: int) -> bool:
        """Whether every stripe overlapping payload bytes ``[start, end)`` matches its CRC at ``expected``
        (checking those ``state`` does not mark checked)."""
        return bool(self._check(address, payload_bytes, stripe, expected, state, start, end))

    def seal_all(self, flats: Sequence[torch.Tensor], payload_bytes: int, stripes: torch.Tensor, mark: int) -> None:
        """Writes each contiguous host uint8 object's row of ``stripes`` (``[objects, stripes]`` int32,
        contiguous) after its payload, then the trailer: their CRC-32C and ``mark`` (all little-endian uint32s).
        One native call for them all; the caller checked that each has room."""
        addresses = array.array("Q", [flat.data_ptr() for flat in flats])
        self._seal_all(addresses.buffer_info()[0], len(flats), payload_bytes, stripes.shape[-1], stripes.data_ptr(),
                       mark)

    def open_tables(self, flats: Sequence[torch.Tensor], payload_bytes: int, stripe: int,
                    mark: int) -> tuple[torch.Tensor, list[bool]]:
        """The stripe CRCs each contiguous host uint8 object of ``flats`` carries after its payload, from one
        allocation and one native call: ``room`` (``[objects, 2, stripes]`` int32: each object's expected CRCs,
        then one zeroed check state per stripe) and whether each opened (not when the object is too short to hold
        its table and trailer, or its trailer does not hold ``mark`` and their CRC-32C)."""
        count, objects = table_stripes(payload_bytes, stripe), len(flats)
        room = torch.empty((objects, 2, count), dtype=torch.int32)
        addresses = array.array("Q", [flat.data_ptr() for flat in flats])
        sizes = array.array("q", [flat.numel() for flat in flats])
        opened = array.array("B", bytes(objects))
        self._open_all(addresses.buffer_info()[0], sizes.buffer_info()[0], objects, payload_bytes, count, mark,
                       room.data_ptr(), opened.buffer_info()[0])
        return room, [bool(flag) for flag in opened]

    def open_objects(self, flats: Sequence[torch.Tensor], payload_bytes: int, stripe: int,
                     mark: int) -> list[ObjectCheck | None]:
        """A load's stripe-by-stripe check of each object of ``flats`` against the stripe CRCs it carries
        (``open_tables``); None where it did not open."""
        room, opened = self.open_tables(flats, payload_bytes, stripe, mark)
        count, flat_room = room.shape[-1], room.view(-1)
        return [ObjectCheck(self, flat, payload_bytes, stripe, flat_room, index, count, flat_room.data_ptr())
                if opened[index] else None for index, flat in enumerate(flats)]

    def verify(self, states: Sequence[ObjectStripes], room: torch.Tensor) -> list[int]:
        """Indices of the objects whose finished stripe states (``states``, from one ``stripe_states`` call, in
        its order) differ from the CRCs they carry (``room`` from ``open_tables``, every object opened): one
        native call for them all."""
        if not states:
            return []
        first = states[0]
        if any(state.registers_address != first.registers_address + 4 * index * first.count
               or state.lengths_address != first.lengths_address + 8 * index * first.count
               for index, state in enumerate(states)):
            raise ValueError("verify takes the stripe states of one stripe_states call, in its order")
        bad = array.array("B", bytes(len(states)))
        differ = self._verify_all(len(states), first.payload_bytes, first.stripe, first.registers_address,
                                  first.lengths_address, room.data_ptr(), 2 * room.shape[-1], bad.buffer_info()[0])
        if differ < 0:
            raise RuntimeError(f"the stripe states of {len(states)} {first.payload_bytes}-byte objects did not get "
                               "every payload byte exactly once")
        return [index for index, flag in enumerate(bad) if flag]

    def object_stripes(self, payload_bytes: int, stripe: int) -> ObjectStripes:
        """An empty stripe state for one object of ``payload_bytes`` bytes."""
        return self.stripe_states(payload_bytes, stripe, 1)[0]

    def stripe_states(self, payload_bytes: int, stripe: int, objects: int) -> list[ObjectStripes]:
        """Empty stripe states for ``objects`` objects of ``payload_bytes`` bytes, from one allocation (a store
        makes one per object it writes, and inside a busy engine each tensor costs several microseconds)."""
        count = -(-payload_bytes // stripe)
        registers = torch.zeros(objects * count, dtype=torch.int32)
        lengths = torch.zeros(objects * count, dtype=torch.int64)
        return [ObjectStripes(self, payload_bytes, stripe, registers, lengths, index) for index in range(objects)]

    def crc(self, address: int, nbytes: int) -> int:
        """CRC-32C of ``nbytes`` at host ``address``."""
        return int(self._one(address, nbytes))

    def portable_crc(self, address: int, nbytes: int) -> int:
        """The same with the table, even where the instruction exists (tests compare the two)."""
        return int(self._portable(address, nbytes))

    def stripes(self, address: int, nbytes: int, stripe: int, first: int, last: int, out_address: int) -> None:
        """CRC-32C of stripes ``[first, last)`` of the ``nbytes`` at ``address`` into uint32s at
        ``out_address``."""
        self._stripes(address, nbytes, stripe, first, last, out_address)

    def stripes_of_objects(self, buffer: torch.Tensor, objects: int, object_bytes: int, payload_bytes: int,
                           stripe: int) -> torch.Tensor:
        """CRC-32Cs (``[objects, stripes]`` int32) of the ``stripe``-byte stripes of the first ``payload_bytes`` of
        ``objects`` objects laid every ``object_bytes`` in the host uint8 ``buffer``: what the GPU kernel computes
        (``kernels.triton_crc32c``), for comparing it with."""
        count = -(-payload_bytes // stripe)
        out = torch.zeros((objects, count), dtype=torch.int32)
        for index in range(objects):
            self.stripes(buffer.data_ptr() + index * object_bytes, payload_bytes, stripe, 0, count,
                         out[index].data_ptr())
        return out


class ObjectStripes:
    """A ``StripeSink``: the stripe CRC-32Cs of one object's payload, built from its bytes in any order, each
    byte once (each stripe's CRC register and byte count so far, in host memory the native code writes: this
    object's share, ``index``, of ``registers`` and ``lengths``, which ``NativeCrc32c.stripe_states`` allocates
    for several)."""

    def __init__(self, lib: NativeCrc32c, payload_bytes: int, stripe: int, registers: torch.Tensor,
                 lengths: torch.Tensor, index: int) -> None:
        self.lib, self.payload_bytes, self.stripe = lib, payload_bytes, stripe
        self.count = -(-payload_bytes // stripe)
        self._states, self._index = (registers, lengths), index
        self.registers_address = registers.data_ptr() + 4 * index * self.count
        self.lengths_address = lengths.data_ptr() + 8 * index * self.count

    @property
    def registers(self) -> torch.Tensor:
        """This object's CRC registers (int32, one per stripe)."""
        return self._states[0][self._index * self.count : (self._index + 1) * self.count]

    @property
    def lengths(self) -> torch.Tensor:
        """This object's bytes hashed so far (int64, one per stripe)."""
        return self._states[1][self._index * self.count : (self._index + 1) * self.count]

    def feed(self, data: torch.Tensor, offset: int) -> None:
        """Adds ``data`` (host, contiguous), the payload's bytes at ``offset``."""
        nbytes = data.numel() * data.element_size()
        status = self.lib.accumulate(data.data_ptr(), nbytes, offset, self.stripe, self.payload_bytes,
                                     self.registers_address, self.lengths_address)
        if status != 0:
            raise RuntimeError(f"payload bytes [{offset}, {offset + nbytes}) overrun the {self.payload_bytes}-byte "
                               f"payload's stripes, {int(self.lengths.sum())} bytes hashed before them")

    def finish(self, out: torch.Tensor) -> None:
        """Writes the stripes' CRC-32Cs into ``out`` (int32, one per stripe, contiguous) once every payload byte
        came, exactly once."""
        status = self.lib.finish(self.payload_bytes, self.stripe, self.registers_address, self.lengths_address,
                                 out.data_ptr())
        if status != 0:
            raise RuntimeError(f"{int(self.lengths.sum())} payload bytes were hashed, the object has "
                               f"{self.payload_bytes}")


class ObjectCheck:
    """A ``StripeCheck``: a load's check of one object against the stripe CRCs it carries: which stripes matched
    so far (one state each, in host memory the native code updates), so each is hashed once however many calls
    need it.

    Object ``index`` of ``room`` (``count`` stripes each, its first byte at ``base``) holds its expected CRCs,
    then its states (zeroed): one int32 each per stripe, filled by ``NativeCrc32c.open_objects``."""

    __slots__ = ("_count", "_first", "address", "expected_address", "flat", "lib", "payload_bytes", "room",
                 "state_address", "stripe")

    def __init__(self, lib: NativeCrc32c, flat: torch.Tensor, payload_bytes: int, stripe: int,
                 room: torch.Tensor, index: int, count: int, base: int) -> None:
        self.lib, self.flat, self.payload_bytes, self.stripe, self.room = lib, flat, payload_bytes, stripe, room
        self._first, self._count = 2 * count * index, count
        self.address = flat.data_ptr()
        self.expected_address = base + 8 * count * index
        self.state_address = self.expected_address + 4 * count

    @property
    def expected(self) -> torch.Tensor:
        """The stripe CRCs this object is checked against."""
        return self.room[self._first : self._first + self._count]

    def check(self, start: int, end: int) -> bool:
        """Whether the stripes overlapping payload bytes ``[start, end)`` all match."""
        return self.lib.check(self.address, self.payload_bytes, self.stripe, self.expected_address,
                              self.state_address, start, end)


@functools.cache
def native() -> NativeCrc32c | None:
    """The native CRC-32C, or None without a (current) native library."""
    lib, _ = load_library()
    if lib is None:
        return None
    if not hasattr(lib, "lmcp_crc32c_verify_all"):
        logger.warning("the native CPU library predates its current CRC-32C functions: chunk checksums use "
                       "zlib's CRC-32, slower, and servers with a current build do not share chunks with this one; %s",
                       REBUILD_HINT)
        return None
    return NativeCrc32c(lib)
