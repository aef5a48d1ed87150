"""Pure description of a model's KV cache (groups -> layers -> planes) and the per-chunk transfer plan.

Imports nothing but torch and the standard library, so every other part of the package (and its tests)
can use it on any machine.
"""

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.files import example_names, load_layout_spec, save_layout_spec
from lmcache_platforms.layout.group_kinds import FullAttention, GroupKind, SlidingWindow, Snapshots, State
from lmcache_platforms.layout.groups import KVGroup, is_saved, saved_indices
from lmcache_platforms.layout.kv_layout import KVLayout, LayerEntry, TransferGroup
from lmcache_platforms.layout.plane import Plane, PlaneGeometry
from lmcache_platforms.layout.slots import (
    chunk_rows,
    chunk_slots,
    physical_rows_per_chunk,
    rows_for_tokens,
    slot_mapping,
)
from lmcache_platforms.layout.spec import LayerSpec, LayoutSpec, PlaneSpec
from lmcache_platforms.layout.tensors import TensorLayout, planes_from_dims, planes_from_tensor

__all__ = [
    "FullAttention", "GroupKind", "KVGroup", "KVLayout", "LayerEntry", "LayerSpec", "LayoutError", "LayoutSpec",
    "Plane", "PlaneGeometry", "PlaneSpec", "SlidingWindow", "Snapshots", "State", "TensorLayout", "TransferGroup",
    "chunk_rows", "chunk_slots", "example_names", "is_saved", "load_layout_spec", "physical_rows_per_chunk",
    "planes_from_dims", "planes_from_tensor", "rows_for_tokens", "save_layout_spec", "saved_indices", "slot_mapping",
]
