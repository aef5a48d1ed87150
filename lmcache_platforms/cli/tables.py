"""Aligned text tables for the commands' human output (``--json`` prints the same data as JSON).

A field that does not apply here (None in every row, e.g. GPU figures on a CPU run) is left out rather than
printed as ``None``; a cell that is None where other rows have a value reads ``-``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

MISSING = "-"


def cell(value: Any) -> str:
    """One value as the tables print it: floats to 3 decimals, lists comma-joined, None as ``-``."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, list | tuple):
        return ",".join(cell(v) for v in value)
    return str(value)


def _numeric(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def grid(head: Sequence[str] | None, rows: Sequence[Sequence[Any]], right: Sequence[bool] | None = None) -> str:
    """``head`` (None: no header line) over ``rows``, two spaces between columns; a column is right-aligned
    where ``right`` says so (default: where every value in it is a number)."""
    texts = ([list(head)] if head is not None else []) + [[cell(v) for v in row] for row in rows]
    width = len(texts[0]) if texts else 0
    if right is None:
        right = [bool(rows) and all(_numeric(row[c]) or row[c] is None for row in rows) for c in range(width)]
    widths = [max(len(r[c]) for r in texts) for c in range(width)]
    lines = ["  ".join(t.rjust(w) if r else t.ljust(w) for t, w, r in zip(line, widths, right, strict=True))
             for line in texts]
    return "\n".join(line.rstrip() for line in lines)


def applicable(rows: Sequence[Mapping[str, Any]], skip: Sequence[str] = ()) -> list[str]:
    """The fields of ``rows`` in first-seen order, less ``skip`` and those None in every row."""
    fields = dict.fromkeys(key for row in rows for key in row if key not in skip)
    return [key for key in fields if any(row.get(key) is not None for row in rows)]


def rows_table(rows: Sequence[Mapping[str, Any]], skip: Sequence[str] = ()) -> str:
    """One line per row, one column per applicable field."""
    fields = applicable(rows, skip)
    return grid(fields, [[row.get(key) for key in fields] for row in rows])


def fields_table(columns: Mapping[str, Mapping[str, Any]], skip: Sequence[str] = ()) -> str:
    """One line per applicable field, one column per named row: for rows too wide to print across."""
    rows = list(columns.values())
    fields = applicable(rows, skip)
    body = [[key, *(row.get(key) for row in rows)] for key in fields]
    right = [False, *([True] * len(rows))]
    return grid(["", *columns], body, right)


def key_values(values: Mapping[str, Any]) -> str:
    """``field  value`` lines for one result, aligned, without the fields that are None."""
    return grid(None, [[key, values[key]] for key in applicable([values])], [False, True])
