"""How a binding's chunk objects get their checksum and how a load verifies it: one decision per binding, made
here, so the binding only moves bytes and hands the kernels what this module gives it.

Three ways, chosen once from where the objects are copied and what can hash (``checksum`` holds the object
format, ``kernels.crc32c`` and ``kernels.triton_crc32c`` the hashers, ``kernels.registry.device_hasher`` the
device's):

- **in the copy** (host objects, the native CRC-32C built): the kernels add each byte to the object's stripe
  state as they copy it (``KernelBackend.store_hashed`` / ``load_hashed``), so a store seals with what they
  hashed and a whole load compares at the end, its rows scrubbed if they differ; a layer-by-layer load checks
  each stripe just before its rows are written (``KernelBackend.load_checked``);
- **on the device** (whole chunks staged in device scratch, a device hasher that agreed with the host): each
  scratch-full is hashed there, and a load compares before that scratch-full's kernels write anything;
- **in a pass** (anything else: layer-by-layer staged chunks, objects without payload, no native library): the
  host hashes the objects after a store's copies, or before a load's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from lmcache_platforms.connector import checksum
from lmcache_platforms.kernels.crc32c import ObjectCheck, ObjectStripes
from lmcache_platforms.kernels.registry import device_hasher
from lmcache_platforms.kernels.stripe_hashing import DeviceStripeHasher


@dataclass
class StoreStripes:
    """Where one store's objects get their stripe CRCs: the kernels' states (``states``, fed as they copy, from
    every layer's pieces in any order), the device (``room``, pinned host memory a side stream fills), or neither
    (``seal`` hashes the objects in a pass)."""

    payload_bytes: int
    states: list[ObjectStripes] | None = None
    room: torch.Tensor | None = None

    def seal(self, hosts: Sequence[torch.Tensor]) -> None:
        """Write each object's stripe table and trailer; call once every byte is in host memory."""
        stripes = self.room
        if self.states is not None:
            stripes = checksum.stripe_room(self.payload_bytes, len(self.states))
            assert stripes is not None, "states exist only where the native CRC-32C does"
            for index, state in enumerate(self.states):
                state.finish(stripes[index])
        checksum.seal(hosts, self.payload_bytes, stripes)


@dataclass
class LoadCheck:
    """A whole load's verification, opened before any byte moves (``ObjectIntegrity.open_load``)."""

    payload_bytes: int
    corrupt: list[int] = field(default_factory=list)
    """Objects found corrupt before anything moved: the load writes nothing."""
    states: list[ObjectStripes] | None = None
    """In the copy: each object's stripe state, which the load's kernels feed; ``written_corrupt`` compares."""
    tables: torch.Tensor | None = None
    room: torch.Tensor | None = None
    """On the device: pinned room each scratch-full's stripe CRCs are read back into; ``differing`` compares."""

    def carried(self, hosts: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        """The stripe CRCs ``hosts`` carry (None where a table fails its trailer), read while the device hashes."""
        return checksum.carried_stripes(hosts, self.payload_bytes)

    def differing(self, carried: Sequence[torch.Tensor | None], first: int) -> list[int]:
        """Indices (in the whole load) of the objects from ``first`` on whose device-made CRCs differ from those
        they carry (``carried``); call once the side stream that made them is finished."""
        assert self.room is not None, "only a load hashed on the device reads stripes back"
        rows = self.room[first : first + len(carried)]
        return [first + index for index in checksum.differing(carried, rows)]

    def written_corrupt(self) -> list[int]:
        """Objects whose bytes, hashed as the kernels wrote them, differ from their table: their rows must be
        scrubbed before anything reads them."""
        if self.states is None or self.tables is None:
            return []
        return checksum.unverified(self.states, self.tables)


@dataclass
class LayerChecks:
    """A layer-by-layer load's verification (``ObjectIntegrity.open_layers``): host objects checked stripe by
    stripe as each layer writes (``checks``), or every object checked whole first (``corrupt``, ``checks`` None)."""

    payload_bytes: int
    corrupt: list[int] = field(default_factory=list)
    checks: list[ObjectCheck] | None = None

    def unmatched(self) -> list[int]:
        """After the last layer: the objects whose stripes do not all match (hashing the ones no row needed)."""
        if self.checks is None:
            return []
        return [index for index, check in enumerate(self.checks) if not check.check(0, self.payload_bytes)]


class ObjectIntegrity:
    """One binding's way of hashing and verifying its chunk objects (see the module docstring)."""

    def __init__(self, device: torch.device, platform: str, staged: bool) -> None:
        """For objects copied from KV caches on ``device`` (memory of ``platform``, a platform name), through
        device scratch when ``staged``."""
        self.device = device
        self.device_hasher: DeviceStripeHasher | None = (
            device_hasher(platform, device) if staged and checksum.stripes_are_crc32c() else None)
        """What hashes whole staged chunks on the device (the kernel registry's choice), or None."""
        self.on_device = self.device_hasher is not None
        """Whether the device hashes now: a switch over ``device_hasher`` (``bench`` turns it off to time the
        host's pass beside the device's)."""
        self.in_copy = not staged and checksum.stripes_are_crc32c()
        """Whether the kernels hash host objects as they copy them."""

    def store_stripes(self, payload_bytes: int, objects: int, whole: bool) -> StoreStripes:
        """What a store of ``objects`` objects hashes into: ``whole`` chunks, or pieces stored layer by layer."""
        if self.in_copy and payload_bytes > 0:
            return StoreStripes(payload_bytes, states=checksum.object_stripes(payload_bytes, objects))
        room = self._device_room(payload_bytes, objects) if whole else None
        return StoreStripes(payload_bytes, room=room)

    def open_load(self, payload_bytes: int, hosts: Sequence[torch.Tensor]) -> LoadCheck:
        """A whole load's check of ``hosts``: in the copy, on the device, or (a pass) done here already. An
        object whose table fails its trailer stops the load before anything moves, every corrupt one named."""
        if self.in_copy and payload_bytes > 0:
            tables = checksum.carried_tables(hosts, payload_bytes)
            if tables is None:
                return LoadCheck(payload_bytes, corrupt=checksum.mismatched(hosts, payload_bytes))
            return LoadCheck(payload_bytes, states=checksum.object_stripes(payload_bytes, len(hosts)), tables=tables)
        room = self._device_room(payload_bytes, len(hosts))
        if room is not None:
            return LoadCheck(payload_bytes, room=room)
        return LoadCheck(payload_bytes, corrupt=checksum.mismatched(hosts, payload_bytes))

    def open_layers(self, payload_bytes: int, hosts: Sequence[torch.Tensor]) -> LayerChecks:
        """A layer-by-layer load's check of ``hosts``: stripe by stripe as each layer is written (host objects,
        the native CRC-32C, every table intact), else every object whole, now."""
        if self.in_copy:
            checks = checksum.object_checks(hosts, payload_bytes)
            if None not in checks:
                return LayerChecks(payload_bytes, checks=[check for check in checks if check is not None])
        return LayerChecks(payload_bytes, corrupt=checksum.mismatched(hosts, payload_bytes))

    def _device_room(self, payload_bytes: int, objects: int) -> torch.Tensor | None:
        """Pinned room for the stripe CRCs of ``objects`` staged objects, when the device hashes them."""
        hasher = self.device_hasher
        if not self.on_device or hasher is None or not hasher.aligned(payload_bytes):
            return None
        return torch.empty((objects, checksum.stripe_count(payload_bytes)), dtype=torch.int32,
                           pin_memory=self.device.type != "cpu")
