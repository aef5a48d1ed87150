"""Show what a layout file moves per LMCache chunk (transfer groups, rows, bytes and kernel launches), or
size a model's KV cache in LMCache's tiers before deploying it.

``--layout`` takes a path or a shipped example name (gemma3, llama8b, deepseek-v4, ...). ``--model`` takes a
local Hugging Face model folder (or its config.json): vLLM's own classes make its KV-cache groups without
reading a weight, and each group's bytes a token and a chunk are shown with the tokens a GiB of CPU memory,
disk and Redis holds. Mode and group rules default to this process's settings (LMCACHE_PLATFORMS_MODE,
..._SAVE_GROUPS, ..._SKIP_GROUPS). A table by default; with ``--json`` the last line printed is one JSON
object instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from lmcache_platforms.cli import model_plan


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--layout", help="layout JSON file or example name")
    what.add_argument("--model", help="a local Hugging Face model folder, or its config.json: size its KV cache "
                                      "in LMCache (see below)")
    parser.add_argument("--mode", choices=("bundled", "exploded"), help="transfer grouping (default: settings)")
    parser.add_argument("--save-groups", help="comma list of group indices/spec names always saved")
    parser.add_argument("--skip-groups", help="comma list of group indices/spec names never saved")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object as the last line instead of the table")
    model_plan.add_arguments(parser)


def _table(summary: dict[str, Any]) -> str:
    head = ("tg", "group", "planes", "layers", "rows/chunk", "bytes/chunk")
    rows = [head] + [
        (str(i), str(tg["group"]), str(tg["planes"]), str(tg["layers"]), str(tg["rows_per_chunk"]),
         str(tg["bytes_per_chunk"]))
        for i, tg in enumerate(summary["transfer_groups"])
    ]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = [f"layout {summary['layout']}: mode {summary['mode']}, chunk {summary['chunk_size']} tokens"]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    skipped = summary["skipped_groups"]
    lines.append(
        f"launches per chunk: {summary['launches_per_chunk']}   chunk bytes: {summary['chunk_bytes']} "
        f"({summary['chunk_bytes'] / 2**20:.2f} MiB)   skipped planes: {summary['skipped_planes']}"
        + (f" (groups {', '.join(map(str, skipped))})" if skipped else "")
    )
    snapshots = summary["snapshot_groups"]
    if snapshots:
        lines.append(f"snapshot groups {', '.join(map(str, snapshots))}: a chunk carries the recurrent state at its "
                     "end (one row) where the caller kept one; whole chunks only")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.model is not None:
        return model_plan.run(args)
    from lmcache_platforms.config import PlatformSettings
    from lmcache_platforms.layout import LayoutError, load_layout_spec
    from lmcache_platforms.tools.fixtures import plan

    try:
        settings = PlatformSettings.load()
        spec = load_layout_spec(args.layout)
        layout = plan(
            spec,
            args.mode or settings.mode,
            state_markers=settings.state_markers,
            save_groups=settings.save_groups if args.save_groups is None else args.save_groups.split(","),
            skip_groups=settings.skip_groups if args.skip_groups is None else args.skip_groups.split(","),
            rows=settings.chunk_rows,
        )
    except (LayoutError, ValueError) as exc:
        print(f"lmcache-platforms plan: {exc}", file=sys.stderr)
        return 2
    summary = {"layout": spec.name, **layout.summary()}
    print(json.dumps(summary) if args.json else _table(summary))
    return 0
