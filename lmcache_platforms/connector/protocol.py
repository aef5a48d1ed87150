"""``LayoutConnector``: what the vLLM integration calls on LMCache's GPU connector when that connector is ours.

The integration reaches the connector through LMCache's engine (``engine.gpu_connector``), typed there as
upstream's interface. Ours (paged and layerwise) also take the KV caches' layout at ``bind`` and keep what it
made as ``binding`` (key tags, release and reacquire around vLLM's sleep mode, transfer counters) and the
chunk ``parts`` they store apart (none: whole chunks); upstream's move one group and have neither, which
``isinstance(connector, LayoutConnector)`` tells apart.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.layout.parts import ChunkPart


@runtime_checkable
class LayoutConnector(Protocol):
    """A GPU connector that moves every group of a bound ``KVLayout``; ``binding`` is None until ``bind``."""

    binding: LayoutBinding | None
    parts: tuple[ChunkPart, ...]

    def bind(self, layout: KVLayout, split: bool = False) -> None: ...
