"""CRC-32C of 64 KiB stripes on the GPU (Triton), so a chunk's checksum is computed where the connector stages
its bytes instead of by a second pass over host memory; the same values as ``csrc/cpu/crc32c.c``.

One program hashes one stripe of one object. Its lanes each run the table-driven CRC (four bytes a step, from a
zero register) over their own piece; CRC is linear over GF(2), so a register carried past k zero bytes is a
fixed matrix times it, and the stripe's register is the xor of each lane's register times the matrix for the
bytes after its piece (the matrices' columns are built here, on the host, once). A stripe shorter than the
rest (an object's last) is read as if zero bytes preceded it, which leave a zero register as it is; only the
start value's share differs, carried past the stripe's own length. Triton is imported on first use (and the
xor reduction is our own: Triton's library functions only run in its interpreter if it was on at import).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

GPU_PLATFORMS = ("cuda", "xpu")
CASTAGNOLI = 0x82F63B78
LANES = 256
LANE_WORDS = 64  # four-byte words per lane: LANES x LANE_WORDS x 4 bytes = one 64 KiB stripe
STRIPE_BYTES = LANES * LANE_WORDS * 4
_ONES = 0xFFFFFFFF
Matrix = tuple[int, ...]  # 32 columns: the image of each register bit


@functools.cache
def _byte_table() -> tuple[int, ...]:
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (CASTAGNOLI if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


def _apply(matrix: Matrix, value: int) -> int:
    out = 0
    for bit in range(32):
        if value >> bit & 1:
            out ^= matrix[bit]
    return out


def _compose(outer: Matrix, inner: Matrix) -> Matrix:
    return tuple(_apply(outer, column) for column in inner)


@functools.cache
def _zero_bytes(count: int) -> Matrix:
    """The matrix carrying a register past ``count`` zero bytes (squaring: lengths are up to 64 KiB)."""
    if count == 0:
        return tuple(1 << bit for bit in range(32))
    if count == 1:
        table = _byte_table()
        return tuple((c >> 8) ^ table[c & 0xFF] for c in (1 << bit for bit in range(32)))
    half = _zero_bytes(count // 2)
    twice = _compose(half, half)
    return _compose(_zero_bytes(1), twice) if count % 2 else twice


def start_share(nbytes: int) -> int:
    """What CRC-32C's start value (all ones) adds to the register after ``nbytes`` bytes, with the final xor (all
    ones too): xored into the data's share, the stripe's CRC."""
    return _apply(_zero_bytes(nbytes), _ONES) ^ _ONES


@functools.cache
def _host_tables() -> tuple[torch.Tensor, torch.Tensor]:
    """Slicing-by-four tables (4 x 256) and each lane's combining columns (LANES x 32), as int32 bit patterns."""
    first = _byte_table()
    tables = [list(first)]
    for _ in range(3):
        tables.append([(c >> 8) ^ first[c & 0xFF] for c in tables[-1]])
    lane = _zero_bytes(LANE_WORDS * 4)
    columns = [_zero_bytes(0)]
    for _ in range(LANES - 1):
        columns.append(_compose(lane, columns[-1]))
    columns.reverse()  # lane i is followed by LANES - 1 - i lanes' bytes

    def int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64).to(torch.int32)

    return int32([v for t in tables for v in t]), int32([v for m in columns for v in m])


@functools.cache
def _device_tables(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(t.to(device) for t in _host_tables())  # type: ignore[return-value]


def _signed(value: int) -> int:
    """A 32-bit pattern as the int32 Triton passes (a value over 2**31 would change the argument's type)."""
    return value - (1 << 32) if value >> 31 else value


def aligned(payload_bytes: int) -> bool:
    """Whether objects of this payload size can be hashed (the kernel reads four-byte words)."""
    return payload_bytes > 0 and payload_bytes % 4 == 0


def supported(buffer: torch.Tensor, payload_bytes: int, object_bytes: int) -> bool:
    """Whether the kernel can hash these objects in ``buffer``: four-byte words everywhere."""
    return aligned(payload_bytes) and object_bytes % 4 == 0 and buffer.data_ptr() % 4 == 0


def usable(platform: str, device: torch.device) -> bool:
    """Whether memory of ``platform`` (a platform name) on ``device`` can be hashed here: CUDA or XPU with Triton
    installed, and on CPU tensors only under Triton's interpreter (tests with a fake runtime)."""
    if platform not in GPU_PLATFORMS or importlib.util.find_spec("triton") is None:
        return False
    return device.type != "cpu" or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    global _xor  # the interpreter finds a kernel's callees among its module's names only

    @triton.jit
    def _xor(a, b):
        return a ^ b

    @triton.jit
    def stripe_crc_kernel(words_ptr, out_ptr, tables_ptr, columns_ptr, object_words, payload_words, stripes,
                          share_full, share_last, LANES: tl.constexpr, LANE_WORDS: tl.constexpr):
        obj = tl.program_id(0).to(tl.int64)
        stripe = tl.program_id(1)
        stripe_words = LANES * LANE_WORDS
        start = stripe * stripe_words
        pad = stripe_words - tl.minimum(payload_words - start, stripe_words)
        lanes = tl.arange(0, LANES)
        base = words_ptr + obj * object_words + start - pad
        reg = (lanes * 0).to(tl.uint32)
        for step in range(LANE_WORDS):
            index = lanes * LANE_WORDS + step
            word = tl.load(base + index, mask=index >= pad, other=0).to(tl.uint32, bitcast=True)
            reg = reg ^ word
            reg = (tl.load(tables_ptr + 768 + (reg & 0xFF)) ^ tl.load(tables_ptr + 512 + ((reg >> 8) & 0xFF))
                   ^ tl.load(tables_ptr + 256 + ((reg >> 16) & 0xFF))
                   ^ tl.load(tables_ptr + (reg >> 24))).to(tl.uint32, bitcast=True)
        bits = tl.arange(0, 32).to(tl.uint32)
        columns = tl.load(columns_ptr + lanes[:, None] * 32 + tl.arange(0, 32)[None, :]).to(tl.uint32, bitcast=True)
        chosen = tl.where(((reg[:, None] >> bits[None, :]) & 1) != 0, columns, 0)
        combined = tl.reduce(tl.reduce(chosen, 1, _xor), 0, _xor)
        share = tl.where(stripe == stripes - 1, share_last, share_full).to(tl.uint32, bitcast=True)
        tl.store(out_ptr + obj * stripes + stripe, (combined ^ share).to(tl.int32, bitcast=True))

    return stripe_crc_kernel


def stripe_crcs(buffer: torch.Tensor, objects: int, object_bytes: int, payload_bytes: int) -> torch.Tensor:
    """CRC-32Cs (int32 bit patterns, ``[objects, stripes]``, on ``buffer``'s device) of the 64 KiB stripes of the
    first ``payload_bytes`` of ``objects`` objects laid every ``object_bytes`` from the start of the uint8
    ``buffer``. Queued on the current stream; check ``supported`` first."""
    span = (objects - 1) * object_bytes + payload_bytes
    if not supported(buffer, payload_bytes, object_bytes) or buffer.numel() < span:
        raise ValueError(f"cannot hash {objects} objects of {payload_bytes} payload bytes every {object_bytes} "
                         f"bytes in a buffer of {buffer.numel()} bytes at address {buffer.data_ptr():#x} (the "
                         "kernel reads four-byte words)")
    stripes = -(-payload_bytes // STRIPE_BYTES)
    last = payload_bytes - (stripes - 1) * STRIPE_BYTES
    out = torch.empty((objects, stripes), dtype=torch.int32, device=buffer.device)
    tables, columns = _device_tables(buffer.device)
    words = buffer[:span].view(torch.int32)
    _kernel()[(objects, stripes)](words, out, tables, columns, object_bytes // 4, payload_bytes // 4, stripes,
                                  _signed(start_share(STRIPE_BYTES)), _signed(start_share(last)), LANES=LANES,
                                  LANE_WORDS=LANE_WORDS)
    return out


def self_check(device: torch.device) -> str | None:
    """Hash two objects (a whole stripe and a short one each) on ``device`` and compare with the native CRC-32C:
    None when they agree, else why not (the kernel failed to build or run there, or computed other values)."""
    from lmcache_platforms.kernels.crc32c import native

    lib = native()
    if lib is None:
        return "the native CPU library is not built: nothing to compare with"
    payload, stride = STRIPE_BYTES + 12, STRIPE_BYTES + 16
    host = torch.randint(0, 256, (stride + payload,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    expected = lib.stripes_of_objects(host, 2, stride, payload, STRIPE_BYTES)
    try:
        got = stripe_crcs(host.to(device), 2, stride, payload).cpu()
    except Exception as exc:  # noqa: BLE001 - any failure to build or run the kernel means "hash on the host"
        return f"the kernel failed on {device}: {type(exc).__name__}: {exc}"
    if not torch.equal(got, expected):
        return f"the kernel computed {got.tolist()} on {device} where the native CRC-32C gives {expected.tolist()}"
    return None

