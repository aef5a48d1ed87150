"""The layout-file schema as data: what ``--layout FILE`` describes, parsed and checked before any tensor exists.

``dims`` name a plane tensor's dimensions in memory order (the tensor is contiguous in that order apart
from block padding): ``nb`` blocks, ``bs`` rows of a block, ``kv`` a K/V split into two planes, any other
name part of a row. Every problem is a LayoutError naming the JSON path of the bad value.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.groups import KVGroup, validate_groups
from lmcache_platforms.layout.slots import rows_for_tokens

_TOP_KEYS = {"name", "chunk_size", "num_tokens", "num_blocks", "shared_buffer", "block_padding_bytes",
             "groups", "layers", "description"}
_GROUP_KEYS = {"block_size", "tokens_per_row", "sliding_window", "state", "snapshots", "name"}
_LAYER_KEYS = {"name", "planes"}
_PLANE_KEYS = {"group", "shape", "dims", "dtype", "name"}


def parse_dtype(name: str, where: str = "dtype") -> torch.dtype:
    """The torch dtype called ``name`` (``bfloat16``, ``int8``, ``float8_e4m3fn`` ...)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and not name.startswith("_") else None
    if not isinstance(dtype, torch.dtype):
        raise LayoutError(f"{where}: unknown dtype {name!r}")
    return dtype


@dataclass(frozen=True)
class PlaneSpec:
    """One tensor of a layer: its group, shape and dim names in memory order, dtype, optional name."""

    group: int
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    dtype: str
    name: str = ""

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


@dataclass(frozen=True)
class LayerSpec:
    name: str
    planes: tuple[PlaneSpec, ...]


@dataclass(frozen=True)
class LayoutSpec:
    """A whole layout file; ``num_blocks`` is per group (the file may give one int for all)."""

    name: str
    chunk_size: int
    num_tokens: int
    num_blocks: tuple[int, ...]
    groups: tuple[KVGroup, ...]
    layers: tuple[LayerSpec, ...]
    shared_buffer: bool = False
    block_padding_bytes: int = 0
    description: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of this spec (``num_blocks`` collapsed to one int when all groups agree)."""
        blocks: int | list[int] = list(self.num_blocks)
        if len(set(self.num_blocks)) == 1:
            blocks = self.num_blocks[0]
        out: dict[str, Any] = {"name": self.name}
        if self.description:
            out["description"] = self.description
        out |= {
            "chunk_size": self.chunk_size,
            "num_tokens": self.num_tokens,
            "num_blocks": blocks,
            "shared_buffer": self.shared_buffer,
            "block_padding_bytes": self.block_padding_bytes,
            "groups": [
                {"block_size": g.block_size, "tokens_per_row": g.tokens_per_row,
                 "sliding_window": g.sliding_window, "state": g.is_state}
                | ({"snapshots": True} if g.snapshots else {})
                | ({"name": g.spec_name} if g.spec_name else {})
                for g in self.groups
            ],
            "layers": [
                {"name": layer.name, "planes": [
                    {"group": p.group, "shape": list(p.shape), "dims": list(p.dims), "dtype": p.dtype}
                    | ({"name": p.name} if p.name else {})
                    for p in layer.planes]}
                for layer in self.layers
            ],
        }
        return out

    @classmethod
    def from_dict(cls, data: Any, source: str = "layout") -> LayoutSpec:
        """Parse and check a layout-file object; errors read ``<source>: <json path>: <problem>``."""
        try:
            return _parse(data)
        except LayoutError as exc:
            raise LayoutError(f"{source}: {exc}") from None


def _obj(value: Any, where: str, keys: set[str], required: tuple[str, ...]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise LayoutError(f"{where}: expected an object, got {type(value).__name__}")
    unknown = sorted(set(value) - keys)
    if unknown:
        raise LayoutError(f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(keys))})")
    for key in required:
        if key not in value:
            raise LayoutError(f"{where}: missing key {key!r}")
    return value


def _int(value: Any, where: str, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise LayoutError(f"{where}: expected an integer >= {minimum}, got {value!r}")
    return value


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise LayoutError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def _list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise LayoutError(f"{where}: expected a non-empty list, got {value!r}")
    return value


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise LayoutError(f"{where}: expected true or false, got {value!r}")
    return value


def _group(index: int, raw: Any) -> KVGroup:
    where = f"groups[{index}]"
    g = _obj(raw, where, _GROUP_KEYS, ("block_size",))
    window = g.get("sliding_window")
    return KVGroup(
        index=index,
        block_size=_int(g["block_size"], f"{where}.block_size"),
        tokens_per_row=_int(g.get("tokens_per_row", 1), f"{where}.tokens_per_row"),
        sliding_window=None if window is None else _int(window, f"{where}.sliding_window"),
        is_state=_bool(g.get("state", False), f"{where}.state"),
        spec_name=_str(g["name"], f"{where}.name") if "name" in g else "",
        snapshots=_bool(g.get("snapshots", False), f"{where}.snapshots"),
    )


def _plane(where: str, raw: Any, num_groups: int) -> PlaneSpec:
    p = _obj(raw, where, _PLANE_KEYS, ("group", "shape", "dims", "dtype"))
    group = _int(p["group"], f"{where}.group", minimum=0)
    if group >= num_groups:
        raise LayoutError(f"{where}.group: group {group} does not exist ({num_groups} groups)")
    shape = tuple(_int(s, f"{where}.shape[{i}]") for i, s in enumerate(_list(p["shape"], f"{where}.shape")))
    dims = tuple(_str(d, f"{where}.dims[{i}]") for i, d in enumerate(_list(p["dims"], f"{where}.dims")))
    if len(dims) != len(shape):
        raise LayoutError(f"{where}: {len(dims)} dims {list(dims)} for shape {list(shape)}")
    if len(set(dims)) != len(dims) or dims.count("nb") != 1 or dims.count("bs") != 1:
        raise LayoutError(f"{where}.dims: need distinct names with exactly one 'nb' and one 'bs', got {list(dims)}")
    if "kv" in dims and shape[dims.index("kv")] != 2:
        raise LayoutError(f"{where}.shape: the 'kv' dim must have size 2, got {shape[dims.index('kv')]}")
    dtype = _str(p["dtype"], f"{where}.dtype")
    parse_dtype(dtype, f"{where}.dtype")
    name = _str(p["name"], f"{where}.name") if "name" in p else ""
    return PlaneSpec(group, shape, dims, dtype, name)


def _parse(data: Any) -> LayoutSpec:
    top = _obj(data, "layout", _TOP_KEYS, ("name", "chunk_size", "num_tokens", "num_blocks", "groups", "layers"))
    groups = tuple(_group(i, g) for i, g in enumerate(_list(top["groups"], "groups")))
    raw_blocks = top["num_blocks"]
    if isinstance(raw_blocks, list):
        if len(raw_blocks) != len(groups):
            raise LayoutError(f"num_blocks: {len(raw_blocks)} entries for {len(groups)} groups")
        num_blocks = tuple(_int(b, f"num_blocks[{i}]", minimum=2) for i, b in enumerate(raw_blocks))
    else:
        num_blocks = (_int(raw_blocks, "num_blocks", minimum=2),) * len(groups)
    layers = []
    for i, raw in enumerate(_list(top["layers"], "layers")):
        layer = _obj(raw, f"layers[{i}]", _LAYER_KEYS, ("name", "planes"))
        planes = tuple(_plane(f"layers[{i}].planes[{j}]", p, len(groups))
                       for j, p in enumerate(_list(layer["planes"], f"layers[{i}].planes")))
        layers.append(LayerSpec(_str(layer["name"], f"layers[{i}].name"), planes))
    spec = LayoutSpec(
        name=_str(top["name"], "name"),
        chunk_size=_int(top["chunk_size"], "chunk_size"),
        num_tokens=_int(top["num_tokens"], "num_tokens"),
        num_blocks=num_blocks,
        groups=groups,
        layers=tuple(layers),
        shared_buffer=_bool(top.get("shared_buffer", False), "shared_buffer"),
        block_padding_bytes=_int(top.get("block_padding_bytes", 0), "block_padding_bytes", minimum=0),
        description=_str(top["description"], "description") if "description" in top else "",
    )
    check_spec(spec)
    return spec


def check_spec(spec: LayoutSpec) -> None:
    """Cross-field checks: group rules, token capacity, names, padding granularity, plane capacity."""
    validate_groups(spec.groups, spec.chunk_size)
    for group, blocks in zip(spec.groups, spec.num_blocks, strict=True):
        needed = math.ceil(rows_for_tokens(spec.num_tokens, group) / group.block_size)
        if needed > blocks - 1:
            raise LayoutError(f"num_blocks: {group.describe()} needs {needed} blocks for {spec.num_tokens} "
                              f"tokens plus the null block 0, has {blocks}")
    names = [layer.name for layer in spec.layers]
    for name in names:
        if names.count(name) > 1:
            raise LayoutError(f"layers: layer name {name!r} appears twice")
    for i, layer in enumerate(spec.layers):
        for j, plane in enumerate(layer.planes):
            where = f"layers[{i}].planes[{j}] ({layer.name})"
            item = plane.torch_dtype.itemsize
            if spec.block_padding_bytes % item:
                raise LayoutError(f"{where}: block_padding_bytes {spec.block_padding_bytes} is not a multiple "
                                  f"of the {plane.dtype} element size {item}")
            group = spec.groups[plane.group]
            slots = plane.shape[plane.dims.index("nb")] * plane.shape[plane.dims.index("bs")]
            if slots < spec.num_blocks[plane.group] * group.block_size:
                raise LayoutError(f"{where}: {slots} slots cannot hold {group.describe()}'s "
                                  f"{spec.num_blocks[plane.group]} blocks x {group.block_size} rows")
