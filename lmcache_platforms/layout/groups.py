"""KV-cache groups (one per vLLM ``KVCacheGroupSpec``) and the rule deciding which of them are saved."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.group_kinds import BUILT_IN_KINDS, GroupKind, kind_from_fields


@dataclass(frozen=True)
class KVGroup:
    """One scheduler group: layers sharing one block table, hence one slot mapping.

    ``block_size`` counts ROWS per block (vLLM 0.32 ``spec.block_size // tokens_per_state``); one row holds
    ``tokens_per_row`` tokens (the compress ratio, 1 for plain attention). ``sliding_window`` is in tokens.

    ``snapshots`` marks a state group whose rows are per-block snapshots of a recurrent state (vLLM's Mamba
    groups in align mode): one row per block, ``tokens_per_row`` = the block's tokens.

    ``kind`` answers every question that differs between kinds of group (``group_kinds``). Left out or built
    in, it is the built-in kind the fields describe, so ``dataclasses.replace`` of a field never leaves a stale
    kind behind; any other kind given is kept.
    """

    index: int
    block_size: int
    tokens_per_row: int = 1
    sliding_window: int | None = None
    is_state: bool = False
    layer_names: tuple[str, ...] = ()
    spec_name: str = ""
    snapshots: bool = False
    kind: GroupKind = None  # type: ignore[assignment]  # set by __post_init__ when not given

    def __post_init__(self) -> None:
        if self.kind is None or type(self.kind) in BUILT_IN_KINDS:
            object.__setattr__(self, "kind", kind_from_fields(self.snapshots, self.is_state, self.sliding_window))

    @property
    def tokens_per_block(self) -> int:
        """Tokens one block covers: what vLLM's scheduler calls the block size."""
        return self.block_size * self.tokens_per_row

    def describe(self) -> str:
        """How error messages name this group."""
        return f"group {self.index}" + (f" ({self.spec_name})" if self.spec_name else "")


def _matches(group: KVGroup, names: Iterable[str]) -> bool:
    return any(name == str(group.index) or (group.spec_name and name == group.spec_name) for name in names)


def looks_like_state(group: KVGroup, state_markers: Sequence[str] = ("State",)) -> bool:
    """A group its kind does not save by default, or one whose spec class name contains a ``state_markers``."""
    return not group.kind.saved_by_default or any(marker and marker in group.spec_name for marker in state_markers)


def is_saved(
    group: KVGroup,
    state_markers: Sequence[str] = ("State",),
    save_groups: Sequence[str] = (),
    skip_groups: Sequence[str] = (),
) -> bool:
    """Whether chunks carry this group: deny list, then allow list, then "state groups are skipped".

    List entries match a group's index (as text) or its exact spec class name. State is skipped by default
    only because it is not needed to resume at a chunk boundary; ``save_groups`` overrides that. Snapshot
    groups are saved: resuming needs them.
    """
    if _matches(group, skip_groups):
        return False
    if _matches(group, save_groups) or group.kind.snapshots:
        return True
    return not looks_like_state(group, state_markers)


def check_group_lists(groups: Sequence[KVGroup], save_groups: Sequence[str], skip_groups: Sequence[str]) -> None:
    """Refuse a ``platforms.save_groups``/``skip_groups`` entry that names no group of this model, or a group both
    lists name: either would otherwise be ignored without a word (the deny list wins over the allow list)."""
    known = ", ".join(g.describe() for g in groups)
    for key, names in (("platforms.save_groups", save_groups), ("platforms.skip_groups", skip_groups)):
        for name in names:
            if not any(_matches(g, (name,)) for g in groups):
                raise LayoutError(f"{key}: {name!r} names no group of this model (a group index or spec class "
                                  f"name; groups: {known})")
    for group in groups:
        if _matches(group, save_groups) and _matches(group, skip_groups):
            raise LayoutError(f"{group.describe()} is in both platforms.save_groups and platforms.skip_groups: "
                              "name it in one")


def saved_indices(
    groups: Sequence[KVGroup],
    state_markers: Sequence[str] = ("State",),
    save_groups: Sequence[str] = (),
    skip_groups: Sequence[str] = (),
) -> tuple[int, ...]:
    """Indices of the groups ``is_saved`` keeps: the decision for layouts that come without vLLM's specs."""
    check_group_lists(groups, save_groups, skip_groups)
    return tuple(g.index for g in groups if is_saved(g, state_markers, save_groups, skip_groups))


def validate_groups(groups: Sequence[KVGroup], chunk_size: int) -> None:
    """Raise LayoutError unless these groups can share one chunk layout.

    Block sizes are compared in TOKENS (``tokens_per_block``): that is the unit vLLM's scheduler aligns
    blocks in and the one chunk boundaries are measured in, so a compressed group with fewer rows per
    block is still aligned with the others. Every group's must divide the largest.
    """
    if chunk_size <= 0:
        raise LayoutError(f"chunk_size must be positive, got {chunk_size}")
    seen: set[int] = set()
    for group in groups:
        name = group.describe()
        if group.index in seen:
            raise LayoutError(f"{name}: index {group.index} appears twice")
        seen.add(group.index)
        if group.block_size <= 0:
            raise LayoutError(f"{name}: block_size must be positive, got {group.block_size}")
        if group.tokens_per_row <= 0:
            raise LayoutError(f"{name}: tokens_per_row must be positive, got {group.tokens_per_row}")
        if chunk_size % group.tokens_per_row:
            raise LayoutError(
                f"{name}: tokens_per_row {group.tokens_per_row} does not divide chunk_size {chunk_size}"
            )
        group.kind.check(group)
    if groups:
        largest = max(g.tokens_per_block for g in groups)
        for group in groups:
            if largest % group.tokens_per_block:
                raise LayoutError(
                    f"{group.describe()}: block of {group.tokens_per_block} tokens does not divide the "
                    f"largest block ({largest} tokens)"
                )
