"""vLLM's KV-cache groups as layout groups, and which of them LMCache chunks carry.

Both vLLM generations are read here: 0.32+ names the compression ``tokens_per_state`` and may mark a group
``enable_kv_transfer=False``; 0.23 (vllm-ascend) names it ``compress_ratio``. A group is either saved,
skipped because resuming provably does not need it, or unrestorable; one unrestorable group means no hit
may ever be claimed for the model (a partly restored cache gives wrong output, a miss only costs time).
A recurrent-state (Mamba) group in vLLM's align mode is saved as a snapshot group (``recurrent.py``: a chunk
carries the state at its end where a vLLM step ended there), unrestorable in any other mode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.recurrent import is_recurrent, snapshot_problem
from lmcache_platforms.layout.groups import KVGroup, check_group_lists, is_saved
from lmcache_platforms.layout.kv_layout import saves_whole_chunks


@dataclass(frozen=True)
class GroupPlan:
    """Every vLLM group (indexed as vLLM orders them) and what the connector does with each."""

    groups: tuple[KVGroup, ...]
    saved: tuple[int, ...]
    skipped: dict[int, str] = field(default_factory=dict)
    unrestorable: dict[int, str] = field(default_factory=dict)

    @property
    def saved_groups(self) -> tuple[KVGroup, ...]:
        return tuple(self.groups[i] for i in self.saved)

    @property
    def multi_group(self) -> bool:
        """More than one group in the chunks: only whole chunks may be saved."""
        return len(self.saved) > 1

    @property
    def whole_chunks_only(self) -> bool:
        """Only whole chunks are saved: the worker's layout applies the same rule (``saves_whole_chunks``)."""
        return saves_whole_chunks(self.saved_groups)

    @property
    def snapshot_groups(self) -> tuple[int, ...]:
        return tuple(i for i in self.saved if self.groups[i].kind.snapshots)

    @property
    def hits_allowed(self) -> bool:
        return bool(self.saved) and not self.unrestorable

    def why_no_hits(self) -> str:
        """One line: the unrestorable groups, those sharing a reason named together (all of a model's Mamba
        layers fail the same setting)."""
        if self.unrestorable:
            by_reason: dict[str, list[int]] = {}
            for index, why in self.unrestorable.items():
                by_reason.setdefault(why, []).append(index)
            return "; ".join(f"{self._name(indices)}: {why}" for why, indices in by_reason.items())
        return "" if self.saved else "no KV-cache group is saved"

    def _name(self, indices: list[int]) -> str:
        if len(indices) == 1:
            return self.groups[indices[0]].describe()
        names = ", ".join(dict.fromkeys(self.groups[i].spec_name for i in indices if self.groups[i].spec_name))
        return f"groups {', '.join(map(str, indices))}" + (f" ({names})" if names else "")

    def describe(self) -> str:
        parts = [f"saved {[self.groups[i].describe() for i in self.saved]}"]
        parts += [f"skipped {self.groups[i].describe()} ({why})" for i, why in self.skipped.items()]
        parts += [f"UNRESTORABLE {self.groups[i].describe()} ({why})" for i, why in self.unrestorable.items()]
        return "; ".join(parts)


def _first_layer_spec(spec: Any) -> Any:
    """A ``UniformTypeKVCacheSpecs`` wraps one spec per layer; the first stands for the group (``_mixed_rows``
    refuses a group whose layers do not store alike)."""
    inner = getattr(spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return next(iter(inner.values()))
    return spec


def manager_window(spec: Any) -> int | None:
    """The sliding window of a group whose blocks vLLM's KV-cache manager frees by a window, else None.

    Only a sliding-window spec is such a group. A full-attention spec carries a window too where vLLM merged
    sliding-window layers into one group with full-attention ones (hybrid manager off): every block is kept
    there and the full-attention layers read every row, so the group is full attention to us. Every layer of
    a group must be windowed for the group to be; the widest window is the group's reach."""
    inner = getattr(spec, "kv_cache_specs", None)
    layers = list(inner.values()) if isinstance(inner, dict) and inner else [spec]
    windows = [getattr(layer, "sliding_window", None) for layer in layers]
    if not all("SlidingWindow" in type(layer).__name__ for layer in layers):
        return None
    sizes = [w for w in windows if isinstance(w, int) and w > 0]
    return max(sizes) if len(sizes) == len(windows) else None


def tokens_per_row(spec: Any) -> int | Fraction:
    """Tokens one stored row covers: 0.32+ ``tokens_per_state``, 0.23 ``compress_ratio``, else 1."""
    spec = _first_layer_spec(spec)
    value: Any = getattr(spec, "tokens_per_state", None)
    if isinstance(value, property) or value is None:
        value = getattr(spec, "compress_ratio", 1)
    return value


def _mixed_rows(spec: Any) -> str | None:
    """Why a group whose layers cover different tokens per stored row cannot be moved as one geometry (vLLM
    0.32 puts DeepSeek-V4's 4- and 128-token compressed layers into one group), or None."""
    inner = getattr(spec, "kv_cache_specs", None)
    if not isinstance(inner, dict):
        return None
    by_ratio: dict[Any, list[str]] = {}
    for name, layer in inner.items():
        by_ratio.setdefault(tokens_per_row(layer), []).append(name)
    if len(by_ratio) < 2:
        return None
    kinds = "; ".join(f"{ratio} tokens a row: {names[0]}" + (f" and {len(names) - 1} more" if len(names) > 1 else "")
                      for ratio, names in by_ratio.items())
    return f"its layers store different tokens per row ({kinds}), which one group's rows cannot describe"


def _unrestorable_reason(spec: Any, ratio: int | Fraction) -> str | None:
    if isinstance(ratio, int) and ratio < 0:
        return "recurrent state without per-chunk snapshots cannot be restored from LMCache chunks"
    if isinstance(ratio, Fraction) and ratio.denominator != 1:
        return f"{ratio} tokens per row (several rows per token) is not supported"
    if getattr(spec, "uses_slot_mapping", True) is False:
        return "the group is not addressed by slot mapping"
    return None


def _snapshot_group(index: int, group_spec: Any, layer: Any, chunk_size: int) -> tuple[KVGroup, str | None]:
    """A recurrent group: one snapshot row per block of ``block_size`` tokens."""
    group = KVGroup(index=index, block_size=1, tokens_per_row=group_spec.kv_cache_spec.block_size, is_state=True,
                    layer_names=tuple(group_spec.layer_names), spec_name=type(layer).__name__, snapshots=True)
    return group, snapshot_problem(layer, chunk_size)


def group_from_spec(index: int, group_spec: Any, settings: PlatformSettings,
                    chunk_size: int = 0) -> tuple[KVGroup, str | None]:
    """One vLLM ``KVCacheGroupSpec`` as a ``KVGroup``, with the reason it cannot be restored (or None);
    ``chunk_size`` is LMCache's, which a recurrent group's block must divide."""
    spec = group_spec.kv_cache_spec
    layer = _first_layer_spec(spec)
    if is_recurrent(layer):
        return _snapshot_group(index, group_spec, layer, chunk_size)
    ratio = tokens_per_row(spec)
    problem = _mixed_rows(spec) or _unrestorable_reason(layer, ratio)
    cr = int(ratio) if problem is None else 1
    spec_name = type(layer).__name__
    group = KVGroup(
        index=index,
        block_size=max(1, spec.block_size // cr),
        tokens_per_row=cr,
        sliding_window=manager_window(spec),
        is_state="Mamba" in spec_name or any(m and m in spec_name for m in settings.state_markers),
        layer_names=tuple(group_spec.layer_names),
        spec_name=spec_name,
    )
    return group, problem


def plan_groups(kv_cache_groups: Sequence[Any], settings: PlatformSettings, chunk_size: int = 0) -> GroupPlan:
    """Decide, for every vLLM group, saved / skipped (with why it is not needed) / unrestorable; LMCache's
    ``chunk_size`` decides whether recurrent groups can be saved."""
    groups: list[KVGroup] = []
    saved: list[int] = []
    skipped: dict[int, str] = {}
    unrestorable: dict[int, str] = {}
    for index, group_spec in enumerate(kv_cache_groups):
        group, problem = group_from_spec(index, group_spec, settings, chunk_size)
        groups.append(group)
        markers, allow, deny = settings.state_markers, settings.save_groups, settings.skip_groups
        if getattr(group_spec, "enable_kv_transfer", True) is False:
            skipped[index] = "enable_kv_transfer=False: vLLM rebuilds it from its source group"
        elif str(index) in deny or group.spec_name in deny:
            skipped[index] = "listed in platforms.skip_groups"
        elif problem is not None:
            unrestorable[index] = problem
        elif not is_saved(group, markers, allow, deny):
            skipped[index] = "state, not needed to resume at a chunk boundary"
        elif getattr(group_spec.kv_cache_spec, "prefix_cacheable", True) is False:
            skipped[index] = "not prefix-cacheable: vLLM resumes a prefix without it"
        else:
            saved.append(index)
    check_group_lists(groups, settings.save_groups, settings.skip_groups)
    return GroupPlan(tuple(groups), tuple(saved), skipped, unrestorable)


def single_group_plan(block_size: int) -> GroupPlan:
    """The plan when vLLM gives no KV-cache config (old two-argument connectors): one full-attention group."""
    return GroupPlan((KVGroup(index=0, block_size=block_size),), (0,))


def recurrent_block_sizes(kv_cache_groups: Sequence[Any]) -> list[int]:
    """Block sizes (tokens) of the recurrent groups in vLLM's align mode: the chunk size must be a multiple."""
    layers = (_first_layer_spec(g.kv_cache_spec) for g in kv_cache_groups)
    return [layer.block_size for layer in layers
            if is_recurrent(layer) and getattr(layer, "mamba_cache_mode", "none") == "align"]
