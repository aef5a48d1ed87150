"""What a load does with a chunk object whose checksum does not match (``connector.checksum``).

The GPU connector checks every object before anything may read the rows it loads (host objects hashed as they are
copied, then compared, a failed object's rows zeroed; on a GPU a scratch-full at a time, before its writes:
``LayoutBinding.load_verified``); if one fails, it calls ``report_corrupt``. It does not know the objects' keys (LMCache
hands it bare MemoryObjs), so ``verified_retrieve`` wraps the engine instance's ``retrieve``: a call that met a
corrupt object returns an all-false mask (no token arrived: vLLM's integration reports the load failed and
recomputes), logs each bad object with its key, and removes it from every LMCache tier so the next lookup
misses instead of failing again. Outside that wrapper (layerwise loads, a caller of the bare engine) a
mismatch raises ``ChecksumMismatch``: no byte that failed its check left in the KV cache, never silently loaded.

``instance_adapter.adapt_engine`` installs it innermost: each part's retrieve goes through it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from typing import Any

import torch

from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.log import init_logger

logger = init_logger(__name__)

# The chunks ``[start, end)`` the current retrieve found corrupt; None outside a wrapped retrieve.
_corrupt: ContextVar[list[tuple[int, int]] | None] = ContextVar("lmcache_platforms_corrupt", default=None)


class ChecksumMismatch(TransferError):
    """A stored chunk object's bytes do not match the checksum written with them."""


def report_corrupt(bounds: Sequence[tuple[int, int]]) -> None:
    """The connector found these corrupt chunks in a batch it loaded: the load failed."""
    found = _corrupt.get()
    if found is None:
        chunks = ", ".join(f"[{start}, {end})" for start, end in bounds)
        raise ChecksumMismatch(f"the stored object of chunk {chunks} fails its checksum: the load failed, no byte "
                               "that failed the check is left in the KV cache")
    found.extend(bounds)


def verified_retrieve(original: Callable[..., Any], engine: Any) -> Callable[..., Any]:
    """``engine``'s retrieve (``original``) made to report and remove corrupt objects."""
    return functools.wraps(original)(functools.partial(_retrieve, original, engine))


def _retrieve(original: Any, engine: Any, tokens: Any, mask: torch.Tensor | None = None,
              **kwargs: Any) -> torch.Tensor:
    found: list[tuple[int, int]] = []
    token = _corrupt.set(found)
    try:
        got = original(tokens, mask, **kwargs)
    finally:
        _corrupt.reset(token)
    if not found:
        return got
    _discard(engine, tokens, mask, kwargs, {start for start, _ in found})
    return torch.zeros_like(got)


def _discard(engine: Any, tokens: Any, mask: torch.Tensor | None, kwargs: dict[str, Any], starts: set[int]) -> None:
    """Log and remove (every tier) the objects of the chunks starting at ``starts``."""
    for start, end, key in engine.token_database.process_tokens(tokens=tokens, mask=mask,
                                                                request_configs=kwargs.get("request_configs")):
        if start not in starts:
            continue
        removed = engine.storage_manager.remove(key)
        logger.error("request %s: LMCache object %s (tokens [%d, %d)) fails its checksum: the load reports no "
                     "token, and the object was removed (%d of its copies)",
                     kwargs.get("req_id"), key.to_string(), start, end, removed)
