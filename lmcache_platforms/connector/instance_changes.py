"""Which methods of live LMCache objects ``instance_adapter`` replaces, when and why, as plain data: ``doctor``
lists them without importing the adapter (and torch's kernels behind it)."""

from __future__ import annotations

from dataclasses import dataclass

ENGINE = "lmcache.v1.cache_engine:LMCacheEngine"
METADATA = "lmcache.v1.metadata:LMCacheMetadata"
METADATA_METHODS = ("get_shapes", "get_dtypes", "get_num_groups")
TAGGED_METHODS = ("lookup",)


@dataclass(frozen=True)
class InstanceChange:
    """Methods of one LMCache class that we replace on an instance, when, and why."""

    target: str
    methods: tuple[str, ...]
    when: str
    why: str


INSTANCE_CHANGES: tuple[InstanceChange, ...] = (
    InstanceChange(METADATA, METADATA_METHODS, "our GPU connector is bound",
                   "LMCache sizes each chunk's MemoryObj from them before any connector code runs"),
    InstanceChange(ENGINE, ("store", "lookup"), "chunks are stored in parts",
                   "each part of a chunk is its own object, in its own shape; a hit needs every part it reads"),
    InstanceChange(ENGINE, TAGGED_METHODS, "a layout is attached",
                   "the scheduler's lookups carry the layout's key tags"),
)
