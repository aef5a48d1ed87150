"""``bench``'s human output: its results as aligned tables, leaving out what does not apply on this machine.

``--json`` prints the results themselves (one object, the last line), unchanged, for scripts.
"""

from __future__ import annotations

from typing import Any

from lmcache_platforms.cli.tables import fields_table, key_values, rows_table

RUN_FIELDS = ("layout", "mode", "device", "threads", "chunks", "bytes", "backend", "upstream_format")


def layout_table(result: dict[str, Any]) -> str:
    """``bench --layout``: what ran on one line, then one figure a line (the upstream, GPU and pinned-memory
    figures only where they were measured)."""
    head = (f"layout {result['layout']}, {result['mode']}, {result['chunks']} chunks ({result['bytes']} bytes) on "
            f"{result['device']}, {result['threads']} threads, backend {result['backend']}"
            + (f"; upstream LMCache's path as {result['upstream_format']}" if result.get("upstream_format") else ""))
    return "\n".join([head, key_values({k: v for k, v in result.items() if k not in RUN_FIELDS})])


def engine_table(result: dict[str, Any]) -> str:
    """``bench --engine``: the run's settings, then one column per tier (and mode) with a figure a line; a tier
    that failed is named with its error below the table."""
    head = (f"{result['model']}, {result['tokens']} tokens x {result['requests']} prompts, chunk "
            f"{result['chunk_size']}, cores {result['cores']}"
            + (", KV-cache events published" if result["kv_events"] else ""))
    done = {f"{row['tier']} ({row['mode']})": row for row in result["tiers"] if "error" not in row}
    failed = [f"tier {row['tier']} ({row['mode']}) failed: {row['error']}" for row in result["tiers"]
              if "error" in row]
    return "\n".join([head, *([fields_table(done, skip=("tier", "mode"))] if done else []), *failed])


def servers_table(result: dict[str, Any]) -> str:
    """``bench --servers``: the workload, then one line per server count."""
    head = (f"{result['model']}, {result['prefix_tokens']}-token prefixes + {result['suffix_tokens']}, "
            f"{result['groups']} prefixes x {result['rounds']} rounds, chunk {result['chunk_size']}, "
            f"{result['concurrency']} in flight per server, cores {result['cores']}")
    return "\n".join([head, rows_table(result["rows"])])
