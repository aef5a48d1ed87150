"""``bench --engine --checksum-cost``: what the chunk checksum costs inside a real engine, measured call by call.

Timing a whole engine with the checksum and again without it compares runs that differ by more than the
checksum does (the same configuration's runs differ by up to 80 % on a busy 2-core machine). Instead, in the
engine pass (installed before the engine starts, measurement only), every host-object kernel call that hashes
or checks (``CpuBackend.store_hashed``, ``load_hashed``, ``load_checked``) is paired with the plain call of the
same arguments (``transfer``: the same bytes written to the same place), which of the two goes first drawn at
random, so that neither always finds the other's bytes in cache or comes first after a forward pass; and the
connector's calls that exist only for the checksum (reading and sealing an object's stripe table, the stripe
states, comparing a load's stripes) are timed, each for the direction it serves (inside
``LayoutBinding.load_verified`` the load's: a load makes its stripe states with the store's functions). The
checksum's cost is then the kernels' difference plus those calls, and the cost without it is LMCache's own figure
minus the paired plain calls, which ran inside it.

These patch our own classes and module functions for one process, not upstream's, so they are not in the
patch registry.
"""

from __future__ import annotations

import functools
import random
import threading
import time
from collections.abc import Callable
from typing import Any

# The connector's checksum-only calls, by the direction they serve outside a paged store or load: module
# functions of ``connector.checksum``, then methods.
_PYTHON_CALLS = {
    "store": (("stripe_room", "object_stripes", "seal"), ("ObjectStripes.finish",)),
    "load": (("object_checks", "mismatched", "carried_tables", "unverified"), ("ObjectCheck.check",)),
}
# The kernel calls paired with a plain twin: (direction, CpuBackend method).
_PAIRED = (("store", "store_hashed"), ("load", "load_hashed"), ("load", "load_checked"))
# "load" on a thread inside ``LayoutBinding.load_verified`` (async loads run beside the engine's stores).
_MOVING = threading.local()


class Totals:
    """Seconds per direction: the kernels' checksummed and paired plain calls, and the checksum-only calls."""

    def __init__(self) -> None:
        self.seconds = {f"{d}_{what}": 0.0 for d in _PYTHON_CALLS for what in ("checksummed", "plain", "python")}
        self.calls = {direction: 0 for direction in _PYTHON_CALLS}

    def as_dict(self) -> dict[str, Any]:
        return {**self.seconds, **{f"{d}_calls": n for d, n in self.calls.items()}}


TOTALS = Totals()
# Which of a pair goes first, drawn per call: taking turns would put the same one first after every forward
# pass whenever a request makes an even number of calls, and the first call after a forward finds vLLM's
# OpenMP threads still spinning.
_ORDER = random.Random(0)


def _timed(direction: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def timed(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            TOTALS.seconds[f"{getattr(_MOVING, 'direction', direction)}_python"] += time.perf_counter() - started

    return timed


def _moving(direction: str, function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def moving(*args: Any, **kwargs: Any) -> Any:
        _MOVING.direction = direction
        try:
            return function(*args, **kwargs)
        finally:
            del _MOVING.direction

    return moving


def _paired(direction: str, hashing: Callable[..., Any]) -> Callable[..., Any]:
    from lmcache_platforms.kernels.contract import Direction

    plain_direction = Direction.STORE if direction == "store" else Direction.LOAD

    @functools.wraps(hashing)
    def paired(backend: Any, planes: Any, slots: Any, buffer: Any, state: Any, offset: int) -> Any:
        TOTALS.calls[direction] += 1
        plain_first = _ORDER.random() < 0.5
        if plain_first:
            _plain(backend, planes, slots, buffer, plain_direction, direction)
        started = time.perf_counter()
        result = hashing(backend, planes, slots, buffer, state, offset)
        TOTALS.seconds[f"{direction}_checksummed"] += time.perf_counter() - started
        if not plain_first:
            _plain(backend, planes, slots, buffer, plain_direction, direction)
        return result

    return paired


def _plain(backend: Any, planes: Any, slots: Any, buffer: Any, plain_direction: Any, direction: str) -> None:
    started = time.perf_counter()
    backend.transfer(planes, slots, buffer, plain_direction)
    TOTALS.seconds[f"{direction}_plain"] += time.perf_counter() - started


def install(setter: Callable[[object, str, Any], None] = setattr) -> None:
    """Pairs and times this process's checksum calls into ``TOTALS``: call once, before the engine starts.
    ``setter`` replaces each attribute (a test passes one that puts them back)."""
    from lmcache_platforms.connector import checksum
    from lmcache_platforms.connector.binding import LayoutBinding
    from lmcache_platforms.kernels import crc32c
    from lmcache_platforms.kernels.cpu_backend import CpuBackend

    for direction, method in _PAIRED:
        setter(CpuBackend, method, _paired(direction, getattr(CpuBackend, method)))
    # Not LMCache's connector classes: importing LMCache here loads llvmlite before vLLM starts, and vLLM 0.32's
    # Triton kernel scan over sys.modules fails on one of llvmlite's objects.
    setter(LayoutBinding, "load_verified", _moving("load", LayoutBinding.load_verified))
    for direction, (functions, methods) in _PYTHON_CALLS.items():
        for name in functions:
            setter(checksum, name, _timed(direction, getattr(checksum, name)))
        for qualified in methods:
            owner, name = qualified.split(".")
            cls = getattr(crc32c, owner)
            setter(cls, name, _timed(direction, getattr(cls, name)))


def cost(totals: dict[str, Any], direction: str, lmcache_seconds: list[float]) -> dict[str, float | None]:
    """Per request of a pass (``lmcache_seconds``: LMCache's cost of each of its stores or loads): the checksum's
    ms, the part of it spent in the connector's Python, and its share of the cost without the checksum.
    None when no call of that direction hashed or checked (a path that does not check host objects)."""
    names = ("ms", "python_ms", "share")
    if not totals.get(f"{direction}_calls") or not lmcache_seconds:
        return {f"checksum_{direction}_{name}": None for name in names}
    python = totals[f"{direction}_python"]
    spent = totals[f"{direction}_checksummed"] - totals[f"{direction}_plain"] + python
    without = sum(lmcache_seconds) - totals[f"{direction}_plain"] - spent
    requests = len(lmcache_seconds)
    values = (spent / requests * 1e3, python / requests * 1e3, spent / without if without > 0 else None)
    return {f"checksum_{direction}_{name}": value for name, value in zip(names, values, strict=True)}
