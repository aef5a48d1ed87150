"""Faults planted into a fuzz pass's own process (negative controls of the oracle; never in the product).

- ``skip-row``: the first row of every chunk of every group is neither stored nor loaded (slot -1): the block
  keeps whatever it held before the load, right by chance where its previous owner had the same prefix.
- ``window-off-by-one``: a sliding-window group keeps one row fewer at the start of its window.
"""

from __future__ import annotations

from typing import Any


def _skip_first_row() -> None:
    from lmcache_platforms.layout import kv_layout

    original = kv_layout.chunks_slots

    def chunks_slots(*args: Any, **kwargs: Any) -> Any:
        slots = original(*args, **kwargs).clone()
        slots[..., 0] = -1
        return slots

    kv_layout.chunks_slots = chunks_slots


def _window_off_by_one() -> None:
    from lmcache_platforms.layout import group_kinds

    original = group_kinds.SlidingWindow.rows

    def rows(self: Any, group: Any, start: int, end: int) -> tuple[int, int]:
        first, count = original(self, group, start, end)
        return (first + 1, count - 1) if count > 1 else (first, count)

    group_kinds.SlidingWindow.rows = rows  # type: ignore[method-assign]


PLANTS = {"skip-row": _skip_first_row, "window-off-by-one": _window_off_by_one}


def install(name: str | None) -> None:
    if name:
        PLANTS[name]()
