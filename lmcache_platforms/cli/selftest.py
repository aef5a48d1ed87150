"""Store a layout's KV caches through a real LMCacheEngine, wipe them, load them back and compare bit for bit.

``--layout`` takes a path or a shipped example name. The planes get random bytes, the request random
distinct non-null block ids per group (loaded back into different ones); only whole chunks are stored when
several groups are saved. Every row that must come back is compared (sliding-window groups: the window tail
of each chunk; skipped state groups: nothing), and every other row must still be zero. Exit 1 when not
bit-exact, 2 on bad input. With ``--json`` the last line printed is one JSON object; when not bit-exact,
``mismatched_rows``/``touched_rows`` count the wrong rows and ``problems`` (first 10) locate them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layout", required=True, help="layout JSON file or example name")
    parser.add_argument("--backend", help="kernel backend: auto, torch, cpu, triton, ascend (default: settings)")
    parser.add_argument("--mode", choices=("bundled", "exploded"), help="transfer grouping (default: settings)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the plane contents and block ids")
    parser.add_argument("--layerwise", action="store_true", help="use LMCache's layerwise store/retrieve")
    parser.add_argument("--local-disk", metavar="DIR",
                        help="keep chunks in LMCache's local disk backend in DIR (no CPU cache)")
    parser.add_argument("--json", action="store_true", help="print one JSON object as the last line")


def _human(result: dict[str, Any]) -> str:
    verdict = "bit-exact" if result["bit_exact"] else "NOT bit-exact"
    lines = [
        f"layout {result['layout']} ({result['mode']}, backend {result['backend']}): {verdict}",
        f"  chunks stored {result['chunks_stored']}, hit {result['chunks_hit']}; rows checked "
        f"{result['rows_checked']}; {result['transfer_groups']} transfer groups, "
        f"{result['launches_per_chunk']} launches per chunk",
    ]
    lines += [f"  problem: {p}" for p in result["problems"]]
    return "\n".join(lines)


def selftest(layout_ref: str, mode: str, backend: str, seed: int = 0, layerwise: bool = False,
             local_disk: str | None = None) -> dict[str, Any]:
    """Run the round trip; the result dict (raises LayoutError/ValueError/BackendUnavailable on bad input)."""
    from lmcache_platforms.config import PlatformSettings
    from lmcache_platforms.layout import load_layout_spec
    from lmcache_platforms.tools import roundtrip
    from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
    from lmcache_platforms.tools.fixtures import materialize

    settings = PlatformSettings.load()
    spec = load_layout_spec(layout_ref)
    layout = materialize(spec, mode, seed=seed, state_markers=settings.state_markers,
                         save_groups=settings.save_groups, skip_groups=settings.skip_groups, rows=settings.chunk_rows)
    request = roundtrip.make_request(layout, spec.num_tokens, seed)
    cache_gib = cache_size_gib(layout, spec.num_tokens)
    # With a disk, keep nothing in the CPU cache so the load really comes from the disk.
    storage = StorageOptions(local_cpu=local_disk is None, max_local_cpu_size=cache_gib, local_disk=local_disk,
                             max_local_disk_size=cache_gib if local_disk else 0.0)
    with LayoutEngine(layout, storage, kernel_backend=backend, layerwise=layerwise) as engine:
        return engine.round_trip(request, spec.name)


def run(args: argparse.Namespace) -> int:
    os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    from lmcache_platforms.config import PlatformSettings
    from lmcache_platforms.kernels.contract import TransferError
    from lmcache_platforms.kernels.registry import BackendUnavailable
    from lmcache_platforms.layout import LayoutError

    if args.local_disk is not None and os.path.exists(args.local_disk) and not os.path.isdir(args.local_disk):
        print(f"lmcache-platforms selftest: --local-disk {args.local_disk}: not a folder (LMCache keeps one file "
              "per chunk in it; give a folder, made if missing)", file=sys.stderr)
        return 2
    try:
        settings = PlatformSettings.load()
        result = selftest(args.layout, args.mode or settings.mode, args.backend or settings.kernel_backend,
                          args.seed, args.layerwise, args.local_disk)
    except TransferError as exc:
        print(f"lmcache-platforms selftest: transfer failed: {exc}", file=sys.stderr)
        return 1
    except (LayoutError, BackendUnavailable, ValueError) as exc:
        print(f"lmcache-platforms selftest: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else _human(result))
    return 0 if result["bit_exact"] else 1
