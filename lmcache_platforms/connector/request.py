"""The keyword arguments our connectors read from ``LMCacheEngine.store/retrieve/store_layer/retrieve_layer``.

LMCache passes unknown keyword arguments through to the GPU connector untouched, so the per-group block
tables travel as one kwarg and the engine needs no change:

``block_ids``: a sequence indexed by KV-cache group index (``KVGroup.index``, vLLM's group order), each the
    request's block table for that group from token 0 (python ints or an int64 tensor), exactly as vLLM's
    scheduler hands them out. Block id 0 is the null block: its rows are never read or written. A caller
    that must not overwrite blocks it already holds (vLLM's prefix cache) passes 0 for them.
``sync`` (upstream's layerwise generators only): whether the compute stream waits for each layer.
``layer_gate`` (optional, the layerwise mode of our vLLM integration): a ``LayerGate``. A store then copies each
    layer once the forward marked it written; a load writes layer by layer in the layout's order and marks each,
    so the forward waits for one layer at a time. The chunk objects are the same as without a gate.
``load_guard`` (optional, loads only): a ``WriteGuard``; the connector writes the KV caches only inside its
    ``run``, which may skip the write (its caller gave up on the load) or record its error instead of
    raising, so LMCache's retrieve still releases its chunk references and the caller reports the failure.

Upstream's ``slot_mapping``/``kvcaches`` kwargs are ignored: the planes come from the bound KVLayout and the
slots are computed per chunk from ``block_ids``.
"""

from __future__ import annotations

import array
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.layout.kv_layout import KVLayout

BLOCK_IDS = "block_ids"
LOAD_GUARD = "load_guard"
LAYER_GATE = "layer_gate"


@dataclass(frozen=True)
class ChunkJob:
    """What a store and a load of one request name (``chunk_stores``, ``chunk_loads``): ``mask`` marks the tokens
    of ``tokens`` to move (a prefix may be left out); ``block_ids`` holds one block table per KV-cache group, from
    token 0; ``request_configs`` key the chunks; with ``gate``, layer by layer."""

    req_id: str
    tokens: torch.Tensor
    block_ids: Sequence[Any]
    request_configs: Mapping[str, Any]
    mask: torch.Tensor | None = None
    gate: LayerGate | None = None

    def wanted(self) -> torch.Tensor:
        n = len(self.tokens)
        return torch.ones(n, dtype=torch.bool) if self.mask is None else self.mask.to("cpu", torch.bool).clone()


class WriteGuard(Protocol):
    """Runs a load's KV-cache writes, or skips them once the load was given up; records errors, never raises."""

    def run(self, write: Callable[[], None]) -> None: ...


def run_guarded(kwargs: Mapping[str, Any], write: Callable[[], None]) -> None:
    """``write()`` inside the caller's ``load_guard`` when one is given, else directly."""
    guard: WriteGuard | None = kwargs.get(LOAD_GUARD)
    if guard is None:
        write()
    else:
        guard.run(write)


def block_ids_from(kwargs: Mapping[str, Any], layout: KVLayout) -> list[torch.Tensor]:
    """The ``block_ids`` kwarg as one CPU int64 tensor per group index; TransferError when unusable."""
    return block_tables(required_block_ids(kwargs), layout)


def required_block_ids(kwargs: Mapping[str, Any]) -> Any:
    """The ``block_ids`` kwarg as given; TransferError naming the kwargs given when it is absent."""
    if BLOCK_IDS not in kwargs:
        raise TransferError(
            f"lmcache_platforms connector needs the kwarg {BLOCK_IDS}=(ids of group 0, ids of group 1, ...); "
            f"got only {sorted(kwargs)}"
        )
    return kwargs[BLOCK_IDS]


def int64_tensor(values: Sequence[int]) -> torch.Tensor:
    """``values`` (token or block ids) as a CPU int64 tensor, through an ``array`` filled in one C loop: a
    prompt's 2,048 token ids in 33 us where ``torch.tensor`` of the list takes 242 us (alone; several times both
    inside a busy engine, on the path of every load and store)."""
    if not values:
        return torch.empty(0, dtype=torch.int64)
    return torch.frombuffer(array.array("q", values), dtype=torch.int64)


def block_tables(raw: Any, layout: KVLayout) -> list[torch.Tensor]:
    """``raw`` block ids (one table per group index) as CPU int64 tensors; TransferError when unusable."""
    if isinstance(raw, torch.Tensor) or not isinstance(raw, Sequence):
        raise TransferError(f"{BLOCK_IDS} must be a sequence with one block list per group, got {type(raw).__name__}")
    needed = max((tg.group for tg in layout.transfer_groups), default=-1) + 1
    if len(raw) < needed:
        raise TransferError(f"{BLOCK_IDS} has {len(raw)} block lists; the layout saves group {needed - 1}")
    out = []
    for index, ids in enumerate(raw):
        tensor = ids if isinstance(ids, torch.Tensor) else int64_tensor(list(ids))
        out.append(tensor.detach().to("cpu", torch.int64).reshape(-1))
        if out[-1].numel() and int(out[-1].min()) < 0:
            raise TransferError(f"{BLOCK_IDS}[{index}] holds negative block id {int(out[-1].min())}")
    return out


def check_chunk(layout: KVLayout, start: int, end: int) -> None:
    """Refuse a partial chunk when several groups are saved (their rows would not cover the same tokens) or a
    snapshot group is (no snapshot exists mid-block)."""
    if layout.whole_chunks_only and end - start != layout.chunk_size:
        raise TransferError(
            f"chunk [{start}, {end}) is partial but the layout saves groups "
            f"{sorted({tg.group for tg in layout.transfer_groups})}: only whole chunks of "
            f"{layout.chunk_size} tokens may be stored (keep save_unfull_chunk off)"
        )
