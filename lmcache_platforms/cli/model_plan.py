"""``plan --model``: what LMCache stores per token and per chunk of a model, so CPU memory, disk and Redis can be
sized before deploying.

vLLM makes the groups (``model_groups``); the connector's own rules decide which it stores
(``integration.vllm.groups.plan_groups``, the settings in force), how a chunk splits into objects (one per
*reach*, ``platforms.chunk_parts``) and how big an object is (payload, checksum tail, padding to whole tokens:
``connector.chunk_format``). A layer's stored row is its state content without vLLM's page padding: K and V
of its KV heads (one latent for MLA), per ``tokens_per_state`` tokens; a recurrent-state group stores one
state a chunk, at the chunk's end.

Per tier, one chunk costs: CPU, each object rounded up to LMCache's allocator alignment; disk, each object as
one file of its bytes; Redis, each object as two keys, its bytes (LMCache's default ``naive`` serde stores
them unchanged) and a metadata record. The tiers' own overheads (file-system blocks, Redis's per-key memory)
come on top.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

from lmcache_platforms.cli.tables import grid

GIB = 1 << 30
REDIS_METADATA_BYTES = 4 * (2 + 5)
"""LMCache 0.5.6 ``RemoteMetadata`` of a one-tensor object: length, format, then dtype and four shape ints."""

KIND_NAMES = (  # the most specific vLLM spec class first
    ("MambaSpec", "recurrent state"),
    ("SlidingWindowMLASpec", "MLA, sliding window"),
    ("MLAAttentionSpec", "MLA"),
    ("SlidingWindowSpec", "sliding window"),
    ("ChunkedLocalAttentionSpec", "chunked local attention"),
    ("FullAttentionSpec", "full attention"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    model = parser.add_argument_group(
        "sizing a model (--model, instead of --layout)",
        "the KV-cache groups vLLM makes for a model folder (its config.json; no weight is read, nothing is "
        "downloaded) and, per group, the bytes LMCache stores a token and a chunk, then tokens per GiB of each "
        "tier (CPU, disk, Redis)")
    model.add_argument("--dtype", default="auto", help="vLLM's --dtype (default auto: the model's)")
    model.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype (default auto)")
    model.add_argument("--block-size", type=int, default=None,
                       help="vLLM's --block-size (default: vLLM's on this platform)")
    model.add_argument("--chunk-size", type=int, default=256, help="LMCache's chunk_size (default 256)")


@dataclass(frozen=True)
class GroupSize:
    """One vLLM group: what it is, and what LMCache would store of it per token and per chunk."""

    index: int
    kind: str
    spec: str
    layers: int
    bytes_per_token: Fraction
    bytes_per_chunk: int
    stored: str
    why: str = ""

    def as_dict(self) -> dict[str, Any]:
        out = {"group": self.index, "kind": self.kind, "spec": self.spec, "layers": self.layers,
               "bytes_per_token": float(self.bytes_per_token), "bytes_per_chunk": self.bytes_per_chunk,
               "stored": self.stored}
        return {**out, "why": self.why} if self.why else out


def _is(spec: Any, class_name: str) -> bool:
    return any(klass.__name__ == class_name for klass in type(spec).__mro__)


def layer_specs(group: Any) -> list[Any]:
    """One spec per layer of a vLLM group (a uniform-type group keeps each layer's own)."""
    inner = getattr(group.kv_cache_spec, "kv_cache_specs", None)
    if isinstance(inner, dict) and inner:
        return list(inner.values())
    return [group.kv_cache_spec] * len(group.layer_names)


def token_bytes(spec: Any) -> Fraction:
    """Bytes one layer of this (attention-like) spec stores per token: its rows' content, without padding."""
    return Fraction(spec.num_heads * spec.state_content_size_bytes) / Fraction(spec.tokens_per_state)


def kind_of(specs: Sequence[Any]) -> str:
    """How the table names a group's kind: the spec kind, its window(s), its compression."""
    names = []
    for spec in specs:
        name = next((text for klass, text in KIND_NAMES if _is(spec, klass)), type(spec).__name__)
        if _is(spec, "MambaSpec"):
            name += f" ({spec.mamba_cache_mode})"
        elif getattr(spec, "sliding_window", None) and "sliding" in name:
            name += f" {spec.sliding_window}"
        elif getattr(spec, "attention_chunk_size", None) and "chunked" in name:
            name += f" {spec.attention_chunk_size}"
        names.append(name)
    kinds = " + ".join(dict.fromkeys(names))
    ratios = sorted({int(s.tokens_per_state) for s in specs if not _is(s, "MambaSpec") and s.tokens_per_state > 1})
    if ratios:
        kinds += f", a row per {' or '.join(map(str, ratios))} tokens"
    return kinds


def group_size(index: int, group: Any, chunk_size: int, stored: str, why: str) -> GroupSize:
    specs = layer_specs(group)
    if all(_is(spec, "MambaSpec") for spec in specs):
        per_chunk = sum(spec.real_page_size_bytes for spec in specs)  # one state, at the chunk's end
        per_token = Fraction(per_chunk, chunk_size)
    else:
        per_token = sum((token_bytes(spec) for spec in specs), Fraction(0))
        per_chunk = math.ceil(per_token * chunk_size)
    spec_names = ", ".join(dict.fromkeys(type(spec).__name__ for spec in specs))
    return GroupSize(index, kind_of(specs), spec_names, len(group.layer_names), per_token, per_chunk, stored, why)


def object_bytes(payload: int, chunk_size: int) -> int:
    """One chunk object of ``payload`` bytes as the connector allocates it: the payload, the checksum tail,
    padding to whole tokens (``connector.chunk_format.paged_format``)."""
    from lmcache_platforms.connector.checksum import tail_bytes

    return -(-(payload + tail_bytes(payload)) // chunk_size) * chunk_size


def chunk_objects(sizes: Sequence[GroupSize], kv_groups: Sequence[Any], chunk_size: int,
                  split: bool) -> list[dict[str, Any]]:
    """The objects of one chunk: one per reach of the stored groups where chunks are split into parts
    (``layout.parts``: full attention, then the widest window first), else one."""
    from lmcache_platforms.layout.parts import group_reach

    saved = [size for size in sizes if size.stored == "yes"]
    by_reach: dict[int | None, list[GroupSize]] = {}
    for size in saved:
        by_reach.setdefault(group_reach(kv_groups[size.index]) if split else None, []).append(size)
    out = []
    for reach in sorted(by_reach, key=lambda r: (r is not None, -(r or 0))):
        payload = sum(size.bytes_per_chunk for size in by_reach[reach])
        out.append({"part": "all" if reach is None else f"reach{reach}",
                    "groups": [size.index for size in by_reach[reach]],
                    "payload_bytes": payload, "object_bytes": object_bytes(payload, chunk_size)})
    return out


def tier_costs(objects: Sequence[dict[str, Any]], chunk_size: int) -> dict[str, dict[str, int]]:
    """Bytes one chunk takes in each tier, and the tokens a GiB of it holds."""
    from lmcache.v1.memory_management import AddressManager

    align = AddressManager.ALIGN_BYTES
    per_chunk = {
        "cpu": sum(-(-o["object_bytes"] // align) * align for o in objects),
        "disk": sum(o["object_bytes"] for o in objects),
        "redis": sum(o["object_bytes"] + REDIS_METADATA_BYTES for o in objects),
    }
    return {tier: {"bytes_per_chunk": nbytes, "tokens_per_GiB": GIB // nbytes * chunk_size if nbytes else 0}
            for tier, nbytes in per_chunk.items()}


def model_summary(args: argparse.Namespace) -> dict[str, Any]:
    """The plan of ``args.model`` as plain data (what ``plan --model --json`` prints)."""
    from lmcache_platforms.cli.model_groups import model_groups
    from lmcache_platforms.config import PlatformSettings
    from lmcache_platforms.integration.vllm.groups import plan_groups, recurrent_block_sizes
    from lmcache_platforms.integration.vllm.recurrent import chunk_size_for

    settings = PlatformSettings.load()
    if args.save_groups is not None or args.skip_groups is not None:
        settings = replace(settings,
                           save_groups=settings.save_groups if args.save_groups is None
                           else tuple(args.save_groups.split(",")),
                           skip_groups=settings.skip_groups if args.skip_groups is None
                           else tuple(args.skip_groups.split(",")))
    made = model_groups(args.model, args.dtype, args.kv_cache_dtype, args.block_size)
    notes = []
    chunk_size = args.chunk_size
    blocks = recurrent_block_sizes(made.groups)
    if blocks:
        chunk_size, line = chunk_size_for(chunk_size, blocks)
        notes.append(line)
    plan = plan_groups(made.groups, settings, chunk_size)
    sizes = []
    for index, group in enumerate(made.groups):
        if index in plan.saved:
            stored, why = "yes", ""
        elif index in plan.unrestorable:
            stored, why = "UNRESTORABLE", plan.unrestorable[index]
        else:
            stored, why = "no", plan.skipped[index]
        sizes.append(group_size(index, group, chunk_size, stored, why))
    if plan.unrestorable:
        notes.append(f"no hit is ever claimed for this model as configured: {plan.why_no_hits()}")
    objects = chunk_objects(sizes, plan.groups, chunk_size, settings.chunk_parts == "window")
    if any(plan.groups[i].kind.snapshots for i in plan.saved):
        notes.append("a recurrent state is stored only for chunks ending where a vLLM step ended: the tier "
                     "figures count one for every chunk, the most it can take")
    saved_bytes = sum(size.bytes_per_chunk for size in sizes if size.stored == "yes")
    return {
        "model": args.model, "architecture": made.architecture, "dtype": made.dtype,
        "kv_cache_dtype": made.kv_cache_dtype, "block_size": made.block_size, "chunk_size": chunk_size,
        "groups": [size.as_dict() for size in sizes],
        "stored_bytes_per_token": saved_bytes / chunk_size,
        "objects_per_chunk": objects,
        "tiers": tier_costs(objects, chunk_size) if objects else {},
        "notes": notes,
    }


def _bytes(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) else f"{value:,.2f}"


def table(summary: dict[str, Any]) -> str:
    """The plan for a person: the groups, the chunk's objects, then each tier."""
    lines = [f"model {summary['model']} ({summary['architecture']}): dtype {summary['dtype']}, KV cache "
             f"{summary['kv_cache_dtype']}, vLLM block {summary['block_size']} tokens, LMCache chunk "
             f"{summary['chunk_size']} tokens"]
    lines.append(grid(
        ("group", "kind", "layers", "bytes/token", "bytes/chunk", "stored"),
        [(g["group"], g["kind"], g["layers"], _bytes(g["bytes_per_token"]), _bytes(g["bytes_per_chunk"]),
          g["stored"] + (f": {g['why']}" if g.get("why") else "")) for g in summary["groups"]],
        (True, False, True, True, True, False)))
    objects = summary["objects_per_chunk"]
    if objects:
        lines.append(f"stored: {_bytes(summary['stored_bytes_per_token'])} bytes a token; a chunk is "
                     + ", ".join(f"{o['part']} (groups {', '.join(map(str, o['groups']))}) {o['object_bytes']:,} B"
                                 for o in objects))
        lines.append(grid(("tier", "bytes/chunk", "tokens/GiB"),
                          [(tier, _bytes(cost["bytes_per_chunk"]), _bytes(cost["tokens_per_GiB"]))
                           for tier, cost in summary["tiers"].items()], (False, True, True)))
        lines.append("(every tier holds the objects' bytes as they are, Redis through LMCache's default naive "
                     "serde; another remote_serde would change Redis's figure)")
    else:
        lines.append("LMCache stores nothing for this model as configured")
    lines += [f"note: {note}" for note in summary["notes"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from lmcache_platforms.cli.model_groups import ModelFolderError

    for option, value in (("--chunk-size", args.chunk_size), ("--block-size", args.block_size)):
        if value is not None and value < 1:
            print(f"lmcache-platforms plan: {option} must be at least 1, got {value}", file=sys.stderr)
            return 2
    try:
        summary = model_summary(args)
    except (ModelFolderError, ValueError) as exc:
        print(f"lmcache-platforms plan: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary) if args.json else table(summary))
    return 0
