"""Our engine impl's life cycle: registering the KV caches (describe, bind, tag keys), vLLM 0.33 sleep mode
(unregister, restore, rebind), a prefix-cache reset, and shutdown.

Sleep mode: between ``unregister_kv_caches`` and ``restore_kv_caches`` nothing of ours touches the KV tensors (the
worker side skips saves and reports loads failed while ``_kv_unregistered`` is set), and restore checks the
tensors did not move.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import psutil
import torch

from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.connector.chunk_format import layout_fingerprint, paged_format
from lmcache_platforms.connector.chunk_loads import engine_brings_objects
from lmcache_platforms.connector.instance_adapter import adapt_engine
from lmcache_platforms.connector.protocol import LayoutConnector
from lmcache_platforms.integration.vllm import health
from lmcache_platforms.integration.vllm.impl_state import ImplState
from lmcache_platforms.integration.vllm.model_identity import MODEL_TAG
from lmcache_platforms.integration.vllm.pending_writes import drain_writes
from lmcache_platforms.integration.vllm.registered_layout import build_layout, cache_dtype_tags, vllm_hint_for
from lmcache_platforms.layout.kv_layout import KVLayout
from lmcache_platforms.log import init_logger

if TYPE_CHECKING:
    from lmcache.v1.config import LMCacheEngineConfig
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

logger = init_logger(__name__)


class KVCacheMovedError(RuntimeError):
    """After vLLM's wake-up a KV cache tensor is no longer where it was bound, and cannot be rebound."""


Signature = tuple[tuple[int, tuple[int, ...], tuple[int, ...], str, str], ...]


def refuse_cpu_tier_beyond(config: Any, available_bytes: int) -> None:
    """LMCache allocates its CPU buffer (``max_local_cpu_size``; every tier stages through it) whole when the engine
    finishes initialising, after vLLM allocated its KV cache. On CPU vLLM sizes that cache to about 90 % of the
    machine's memory unless ``VLLM_CPU_KVCACHE_SPACE`` says otherwise, and a buffer that no longer fits has the
    worker killed for memory with no word of why: refused here, naming both sizes. (LMCache sizes the buffer of
    an MLA rank that stores alone itself, from the memory left.)"""
    wanted = int(float(config.max_local_cpu_size) * 2**30)
    if wanted > available_bytes:
        raise MemoryError(
            f"LMCache's CPU buffer (max_local_cpu_size: {config.max_local_cpu_size} GiB) does not fit in the "
            f"{available_bytes / 2**30:.1f} GiB of memory left after vLLM's KV cache: lower max_local_cpu_size, "
            "or give vLLM's KV cache less memory (on CPU: VLLM_CPU_KVCACHE_SPACE, in GiB)")


def _tensors(value: Any) -> list[torch.Tensor]:
    """A registered layer's tensors: one tensor, or (vLLM 0.23 / vllm-ascend) a tuple or list of them."""
    return [value] if isinstance(value, torch.Tensor) else [t for item in value for t in _tensors(item)]


def kv_signature(value: Any) -> Signature:
    """What a layer's bound planes depend on: each tensor's address, shape, strides, dtype and device."""
    return tuple((t.data_ptr(), tuple(t.shape), tuple(t.stride()), str(t.dtype), str(t.device))
                 for t in _tensors(value))


def moved_layers(bound: Mapping[str, Signature], kv_caches: Mapping[str, Any]) -> dict[str, str]:
    """Layer name -> how its tensors differ from what was bound (only the layers that differ)."""
    moved = {}
    for name, was in bound.items():
        value = kv_caches.get(name)
        now = kv_signature(value) if value is not None else None
        if now != was:
            moved[name] = "gone" if now is None else f"was {_describe(was)}, now {_describe(now)}"
    return moved


def _describe(signature: Signature) -> str:
    return "; ".join(f"{hex(ptr)} {list(shape)} {dtype} on {device}" for ptr, shape, _, dtype, device in signature)


def _bind(connector: LayoutConnector, layout: KVLayout, split: bool) -> LayoutBinding:
    """Bind ``layout`` to our GPU connector (its chunks ``split`` into parts or whole); the binding it made."""
    connector.bind(layout, split=split)
    assert connector.binding is not None  # bind always sets it
    return connector.binding


def whole_chunk_reader(lmcache_config: Any, engine: Any) -> str | None:
    """Why LMCache's remote store could read only whole chunks, or None. A remote connector that does not save
    each object's metadata (``save_chunk_meta: false``, or one that never does) sizes every read as a whole
    chunk, so a part would come back as the wrong size and every load would fail."""
    extra = getattr(lmcache_config, "extra_config", None) or {}
    if getattr(lmcache_config, "remote_url", None) and extra.get("save_chunk_meta", True) is False:
        return "LMCache's extra_config sets save_chunk_meta: false for the remote store"
    backends = getattr(getattr(engine, "storage_manager", None), "storage_backends", {})
    for name, backend in backends.items():
        connection = getattr(backend, "connection", None)
        if connection is not None and getattr(connection, "save_chunk_meta", True) is False:
            return f"LMCache's {name} ({type(connection).__name__}) stores no per-object metadata"
    return None



class Lifecycle(ImplState):
    """Registering, unregistering and restoring the KV caches; reset; shutdown."""

    _kv_signatures: dict[str, Signature]
    _shut_down: bool

    def _init_connector_state(self, role: KVConnectorRole, vllm_config: VllmConfig,
                              config: LMCacheEngineConfig) -> None:
        super()._init_connector_state(role, vllm_config, config)
        self._kv_signatures = {}
        self._shut_down = False

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Describe the caches (raising on a layout we cannot read), hand them to the GPU connector, then let
        LMCache finish initialising (upstream's post_init)."""
        if self.kv_caches:
            raise RuntimeError("register_kv_caches called twice")
        if not kv_caches:
            raise ValueError("register_kv_caches got no KV caches")
        if self.plan.saved and self.lmcache_engine is not None:  # degraded mode moves nothing
            self._attach_layout(kv_caches)
        self.kv_caches = kv_caches
        self._kv_signatures = {name: kv_signature(value) for name, value in kv_caches.items()}
        if self.lmcache_engine is not None and not self.lmcache_engine.save_only_first_rank:
            refuse_cpu_tier_beyond(self.config, psutil.virtual_memory().available)
        self._manager.post_init()
        health.record(self.role_name, "post_init", self._manager)

    def _attach_layout(self, kv_caches: dict[str, Any]) -> None:
        """Bind the caches' layout to our GPU connector; its key tags and the model's identity then go into
        every store, load and lookup. Upstream's connector is refused: it needs the KV tensors and per-token
        slots in every call, which our metadata does not carry (the catalog installs our connector factory with
        this impl)."""
        engine = self.lmcache_engine
        connector = engine.gpu_connector
        if not isinstance(connector, LayoutConnector):
            raise RuntimeError(f"LMCache's GPU connector is {type(connector).__name__}, not lmcache_platforms' "
                               f"({self.plan.describe()}). Is lmcache_platforms activated in this process?")
        self.layout = build_layout(kv_caches, self.plan, self._lmcache_chunk_size, self.settings,
                                   vllm_hint_for(self._vllm_config), self._num_blocks)
        if self.layout.whole_chunks_only and not self.plan.whole_chunks_only and self.config.save_unfull_chunk:
            raise ValueError("this KV cache is moved only as whole block pages (vLLM's CPU attention in AMX tiles), "
                             "so only whole chunks can be stored: set LMCache's save_unfull_chunk to false")
        binding = _bind(connector, self.layout, self._split_chunks())
        self._key_tags = {**binding.key_tags, **cache_dtype_tags(self._vllm_config), MODEL_TAG: self.model.tag}
        adapt_engine(engine, connector.parts, self._lmcache_chunk_size, self._key_tags)

    def _split_chunks(self) -> bool:
        """Chunk parts (``connector.parts``) unless the setting says whole, LMCache's engine brings a load's
        objects itself (an MLA rank's broadcast, a PD receiver: ``chunk_loads.engine_brings_objects``), or a remote
        store reads chunks whole (logged)."""
        split = self.settings.chunk_parts == "window" and not engine_brings_objects(self.lmcache_engine)
        reason = whole_chunk_reader(self.config, self.lmcache_engine) if split else None
        if reason is not None:
            logger.info("platforms.chunk_parts=window but %s: chunks are stored whole", reason)
        mixed = 0 < len(self.plan.snapshot_groups) < len(self.plan.saved)
        if mixed and not (split and reason is None):
            logger.warning("recurrent state groups with chunks stored whole: a chunk is stored only where vLLM "
                           "kept its state, so a hit reaches only as far as every chunk kept one (store chunks "
                           "in parts, platforms.chunk_parts=window with LMCache's sync loading, to hit at any "
                           "step budget)")
        return split and reason is None

    def unregister_kv_caches(self) -> None:
        """Before sleep mode unmaps the KV memory: from here on no store or load touches the KV tensors (saves
        are skipped, loads reported failed, and the binding refuses transfers from LMCache's own threads).
        vLLM has drained its transfers; ours are synchronous, and the binding waits for its streams anyway.
        References to the tensors are kept: vLLM keeps them too, and restore needs them. Idempotent."""
        if self._kv_unregistered:
            return
        self._kv_unregistered = True
        self._skips_logged = False
        binding = self._binding()
        if binding is not None:
            binding.release("unregistered for vLLM sleep mode")
        if self.kv_caches:
            logger.info("KV caches unregistered (vLLM sleep mode): LMCache stores and loads are off until "
                        "restore_kv_caches")

    def restore_kv_caches(self) -> None:
        """After wake-up: transfers resume once every registered KV tensor is where it was bound (the cumem
        allocator maps the same virtual addresses again; the contents are gone, which costs nothing here since
        LMCache's chunks live outside them). A tensor that moved is rebound if the chunk format stays the
        same, else KVCacheMovedError names it and transfers stay off. Idempotent."""
        if not self._kv_unregistered:
            return
        moved = moved_layers(self._kv_signatures, self.kv_caches)
        if moved:
            self._rebind(moved)
        binding = self._binding()
        if binding is not None:
            binding.reacquire()
        self._kv_unregistered = False
        if self.kv_caches:
            logger.info("KV caches restored after vLLM sleep mode: LMCache stores and loads are back on")

    def _rebind(self, moved: dict[str, str]) -> None:
        """Bind the layout of the tensors vLLM now holds, or refuse. ``self.kv_caches`` is the dict vLLM
        registered, whose tensor objects its attention layers use: a backend that moves the memory keeps those
        objects and repoints them (``set_``), or replaces the dict's entries."""
        listed = "; ".join(f"layer {name!r}: {how}" for name, how in list(moved.items())[:4])
        engine = self.lmcache_engine
        connector = getattr(engine, "gpu_connector", None)
        if self.layout is None or not isinstance(connector, LayoutConnector):
            self._kv_signatures = {name: kv_signature(value) for name, value in self.kv_caches.items()}
            return  # nothing bound (degraded mode or nothing saved): nothing to rebind
        old_binding = connector.binding
        assert old_binding is not None  # self.layout is set only once the connector is bound
        try:
            layout = build_layout(self.kv_caches, self.plan, self._lmcache_chunk_size, self.settings,
                                  vllm_hint_for(self._vllm_config), self._num_blocks)
        except (ValueError, RuntimeError) as exc:  # LayoutError, TransferError, UnknownCacheLayout
            raise KVCacheMovedError(f"KV caches moved during vLLM sleep mode ({listed}) and their layout cannot "
                                    f"be described: {exc}; transfers stay off") from exc
        fmt = paged_format(layout)
        now = [paged_format(layout, part.transfer_groups) for part in connector.parts] or [fmt]
        was = old_binding.formats
        if [(f.fingerprint, f.shape, f.dtype) for f in now] != [(f.fingerprint, f.shape, f.dtype) for f in was]:
            raise KVCacheMovedError(
                f"KV caches moved during vLLM sleep mode ({listed}) and their chunk format changed (key tag "
                f"{old_binding.fingerprint} -> {layout_fingerprint(now)}, {sum(f.nbytes for f in was)} -> "
                f"{sum(f.nbytes for f in now)} bytes per chunk): LMCache's chunk shape and keys were fixed when "
                "the caches were registered; transfers stay off")
        binding = _bind(connector, layout, bool(connector.parts))
        binding.counters = old_binding.counters
        self.layout = layout
        self._kv_signatures = {name: kv_signature(value) for name, value in self.kv_caches.items()}
        logger.warning("KV caches moved during vLLM sleep mode (%s); rebound the same chunk format (key tag %s)",
                       listed, binding.fingerprint)

    def shutdown(self) -> None:
        """Chunk writes still in flight to LMCache's slower tiers finish first (bounded), so a server stopped
        right after a request keeps that request's chunks for the next one; then upstream's shutdown. Idempotent:
        vLLM's engine shutdown and the exit hook (``exit_shutdown``) may both call it."""
        if self._shut_down:
            return
        self._shut_down = True
        self.loads.shutdown()
        if self.lmcache_engine is not None:
            drain_writes(self.lmcache_engine, timeout_s=self.settings.drain_timeout_s)
        super().shutdown()

    def reset_cache(self) -> bool:
        """vLLM reset its prefix cache and asked us too: KV computed before never hits again. Nothing is deleted
        (the store may be shared, and LMCache's tiers cannot be cleared at once): every later lookup uses a new
        generation of scopes instead. A request keeps the generation of its latest lookup: one running now stores
        its KV, computed before, in the old one; one preempted is looked up again."""
        self._generation = secrets.token_hex(8)
        self.kv_events.cleared()
        self.stats.count("resets")
        logger.info("vLLM reset its prefix cache: LMCache's chunks stored before are no longer looked up "
                    "(scope generation %s)", self._generation)
        return True

