"""The one transfer operation every kernel backend implements, and the checks made before any byte moves."""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence

import torch

from lmcache_platforms.kernels.stripe_hashing import StripeCheck, StripeSink
from lmcache_platforms.layout.plane import Plane, buffer_bytes


class Direction(enum.Enum):
    """STORE copies paged planes into the chunk buffer (D2H); LOAD copies the buffer back (H2D)."""

    STORE = "store"
    LOAD = "load"


class TransferError(ValueError):
    """A transfer was refused before anything was written."""


def validate_transfer(planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor) -> None:
    """Raise TransferError naming the offending plane/value unless the call is well formed.

    ``slots`` is int64, ``[R]`` (every plane uses the same slots) or ``[P, R]`` (one list per plane);
    negative slots are skipped. ``buffer`` is contiguous, of any dtype, ``buffer_bytes(planes, R)`` bytes.
    """
    _check_slot_shape(planes, slots)
    if not buffer.is_contiguous():
        raise TransferError("the chunk buffer must be contiguous")
    rows = slots.shape[-1]
    want = buffer_bytes(planes, rows)
    got = buffer.numel() * buffer.element_size()
    if got != want:
        raise TransferError(f"chunk buffer holds {got} bytes, {rows} rows of these planes need {want}")
    _check_slot_bounds(planes, slots)


def validate_chunks(planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, chunk_stride: int) -> None:
    """``validate_transfer`` for a batch of N chunks moved by one call (``KernelBackend.transfer_chunks``).

    ``slots`` is int64 ``[N, R]`` or ``[N, P, R]``: chunk i's slots as ``transfer`` takes them; no valid slot
    may appear in two chunks (a load would write it twice). ``buffer`` is a contiguous uint8 tensor holding
    chunk i's ``buffer_bytes(planes, R)`` bytes at byte ``i * chunk_stride``; chunks may not overlap.
    """
    if slots.dim() not in (2, 3):
        raise TransferError(f"batched slots must be [N, R] or [N, P, R], got shape {tuple(slots.shape)}")
    # Every chunk's rows side by side: the slot checks are those of one call over all of them.
    together = slots.reshape(-1) if slots.dim() == 2 else slots.transpose(0, 1).reshape(slots.shape[1], -1)
    _check_slot_shape(planes, together)
    if buffer.dtype != torch.uint8 or buffer.dim() != 1 or not buffer.is_contiguous():
        raise TransferError("the chunks' buffer must be a contiguous 1-D uint8 tensor")
    count, per_chunk = slots.shape[0], buffer_bytes(planes, slots.shape[-1])
    if chunk_stride < per_chunk:
        raise TransferError(f"chunks {chunk_stride} bytes apart overlap: each holds {per_chunk} bytes")
    want = (count - 1) * chunk_stride + per_chunk if count else 0
    if buffer.numel() < want:
        raise TransferError(f"the chunks' buffer holds {buffer.numel()} bytes, {count} chunks of {per_chunk} bytes "
                            f"{chunk_stride} bytes apart need {want}")
    _check_slot_bounds(planes, together)


def _check_slot_shape(planes: Sequence[Plane], slots: torch.Tensor) -> None:
    if not planes:
        raise TransferError("a transfer group needs at least one plane")
    if slots.dtype != torch.int64:
        raise TransferError(f"slots must be int64, got {slots.dtype}")
    if slots.dim() == 2:
        if slots.shape[0] != len(planes):
            raise TransferError(f"slots has {slots.shape[0]} rows for {len(planes)} planes")
    elif slots.dim() != 1:
        raise TransferError(f"slots must be [R] or [P, R], got shape {tuple(slots.shape)}")


def _check_slot_bounds(planes: Sequence[Plane], slots: torch.Tensor) -> None:
    rows = slots.shape[-1]
    if rows == 0:
        return
    # A list shared by every plane has one maximum: reducing it once keeps the reduction small (one over an
    # expanded [planes, rows] view is large enough to start torch's OpenMP threads, whose spinning afterwards
    # takes the core the native kernel's helper thread needs).
    highest = slots.max(dim=1).values.tolist() if slots.dim() == 2 else [int(slots.max())] * len(planes)
    for plane, top in zip(planes, highest, strict=True):
        if plane.storage is None:
            raise TransferError(f"plane {plane.name!r} of layer {plane.layer!r} has no tensor behind it")
        if top >= plane.geometry.num_slots:
            raise TransferError(
                f"slot {top} is beyond plane {plane.name!r} of layer {plane.layer!r} "
                f"({plane.geometry.num_slots} slots: {plane.geometry.num_blocks} blocks x "
                f"{plane.geometry.rows_per_block} rows)"
            )


class KernelBackend(abc.ABC):
    """A way to run the transfer; the registry asks ``availability`` and ``unsupported`` before choosing it."""

    name: str

    @abc.abstractmethod
    def availability(self) -> tuple[bool, str]:
        """(usable on this machine, why or why not)."""

    def unsupported(self, planes: Sequence[Plane]) -> str | None:
        """None when this backend can move these planes, else the reason it cannot."""
        return None

    @abc.abstractmethod
    def transfer(
        self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, direction: Direction
    ) -> None:
        """Move every row with a non-negative slot between the planes and ``buffer``; validate first.

        ``slots`` may be in host memory or on the planes' device: host slots are checked without waiting for
        the device and copied across by the backend (what the connector passes); checking device slots reads
        them back, a synchronisation per call."""

    def store_hashed(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                     stripes: StripeSink, offset: int) -> None:
        """A store into host ``buffer``, the object's payload bytes from ``offset``, that also adds every byte it
        holds afterwards to ``stripes`` (``kernels.crc32c``). This default stores, then hashes the buffer; a
        backend that can hashes the bytes as it writes them (no second pass over memory)."""
        self.transfer(planes, slots, buffer, Direction.STORE)
        stripes.feed(buffer, offset)

    def load_hashed(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                    stripes: StripeSink, offset: int) -> None:
        """A load from host ``buffer``, the object's payload bytes from ``offset``, that also adds every byte it
        reads to ``stripes``: the rows are written whatever their bytes, and the caller compares the finished
        stripes with those the object carries before anything may read the rows. This default hashes the buffer,
        then loads; a backend that can hashes the bytes as it copies them (one pass over the object)."""
        stripes.feed(buffer, offset)
        self.transfer(planes, slots, buffer, Direction.LOAD)

    def load_checked(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor, check: StripeCheck,
                     offset: int) -> bool:
        """A load from host ``buffer``, the object's payload bytes from ``offset``, that writes only bytes whose
        stripe matches the CRC the object carries; False when one does not (the load stopped there). This
        default checks every stripe the buffer overlaps, then loads; a backend that can checks each stripe
        just before its rows are written, reading it from cache."""
        if not check.check(offset, offset + buffer.numel() * buffer.element_size()):
            return False
        self.transfer(planes, slots, buffer, Direction.LOAD)
        return True

    def transfer_chunks(self, planes: Sequence[Plane], slots: torch.Tensor, buffer: torch.Tensor,
                        chunk_stride: int, direction: Direction) -> None:
        """``transfer`` for a batch of chunks (``validate_chunks`` says what the arguments hold); every chunk
        is checked before any byte moves. A backend whose cost is per call (a GPU launch from Python) moves
        the whole batch in one call; this default moves the chunks one by one."""
        validate_chunks(planes, slots, buffer, chunk_stride)
        per_chunk = buffer_bytes(planes, slots.shape[-1])
        for index in range(slots.shape[0]):
            start = index * chunk_stride
            self.transfer(planes, slots[index], buffer[start : start + per_chunk], direction)
