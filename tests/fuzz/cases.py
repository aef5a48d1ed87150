"""A fuzz case from a seed: settings drawn from every dimension docs/support-matrix.md claims, and a workload that goes
looking for stale rows (prompt lengths at and around chunk, block and window boundaries, shared prefixes and
branches, prompts that come back after others reused their blocks, concurrent batches).

A case is plain data (``Case.spec``), so a failure replays from its seed alone.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

CONNECTORS = ("LMCachePlatformsConnector", "LMCacheConnectorV1", "LMCacheConnectorV1Dynamic")
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "model": ("hybrid", "dense"),
    "connector": CONNECTORS,
    "hma": (True, False),
    "chunk_size": (128, 256),
    "block_size": (None, 32, 64),
    "chunk_parts": ("window", "whole"),
    "chunk_rows": ("blocks", "tokens"),
    "load_mode": ("sync", "async"),
    "layerwise": (False, True),
    "tier": ("cpu", "disk", "fs"),
    "prefix_caching": (False, True),
    "kv_cache_dtype": ("auto", "fp8"),
    "kv_cache": ("roomy", "tight"),
}
WINDOW = 96  # the hybrid model's sliding window: not a multiple of any block size drawn
MAX_PROMPT = 1500
MAX_TOKENS = 16


@dataclass
class Case:
    seed: int
    settings: dict[str, Any]
    batches: list[list[list[int]]]
    plant: str | None = None
    poison: bool = True
    notes: list[str] = field(default_factory=list)
    incomparable: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    one_token: int = 0
    fixed: dict[str, Any] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return sum(len(b) for b in self.batches)

    def effective_block(self) -> int:
        return self.settings["block_size"] or 128

    def spec(self, model_dir: str, reference: bool, workdir: str) -> dict[str, Any]:
        s = self.settings
        extra: dict[str, Any] = {
            "lmcache.chunk_size": s["chunk_size"],
            "lmcache.use_layerwise": s["layerwise"],
            "platforms.chunk_parts": s["chunk_parts"],
            "platforms.chunk_rows": s["chunk_rows"],
            "platforms.load_mode": s["load_mode"],
            "platforms.poison_loads": self.poison,
        }
        if s["tier"] == "cpu":
            extra.update({"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 1.0})
        elif s["tier"] == "disk":
            extra.update({"lmcache.local_cpu": False, "lmcache.local_disk": f"file://{workdir}/disk/",
                          "lmcache.max_local_disk_size": 1.0})
        else:  # a shared file-system store behind a small CPU tier that evicts
            extra.update({"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.02,
                          "lmcache.remote_url": f"fs://localhost:0{workdir}/fs", "lmcache.remote_serde": "naive"})
        engine: dict[str, Any] = {
            "max_model_len": 2048,
            "kv_cache_dtype": s["kv_cache_dtype"],
            "enable_prefix_caching": s["prefix_caching"],
            "disable_hybrid_kv_cache_manager": not s["hma"],
        }
        if s["block_size"]:
            engine["block_size"] = s["block_size"]
        if s["kv_cache"] == "tight":  # one longest request's blocks and a few more: concurrent batches preempt
            groups = 3 if s["model"] == "hybrid" and s["hma"] else 1
            engine["num_gpu_blocks_override"] = groups * -(-2048 // self.effective_block()) + 4
        return {"model_dir": model_dir, "connector": s["connector"], "extra_config": extra, "engine": engine,
                "reference": reference, "max_tokens": MAX_TOKENS, "batches": self.batches,
                "plant": None if reference else self.plant}


def _draw_settings(rng: random.Random, pages_only: bool, fixed: dict[str, Any]) -> dict[str, Any]:
    s = {name: rng.choice(values) for name, values in DIMENSIONS.items()}
    s.update(fixed)
    if s["connector"] != "LMCachePlatformsConnector":
        s["hma"] = False  # neither upstream name declares HMA support: vLLM turns the hybrid manager off
    if pages_only:
        s["chunk_rows"] = "blocks"  # this CPU's AMX cache moves only whole block pages
    return s


def _boundaries(chunk: int, block: int) -> list[int]:
    """Lengths a stale or missing row would hide at: chunk, block and window edges, one either side."""
    edges = {chunk * k for k in range(1, 6)} | {block * k for k in range(1, 8)} | {WINDOW, chunk + WINDOW}
    return sorted({e + d for e in edges for d in (-1, 0, 1) if 1 < e + d <= MAX_PROMPT - 100})


def _draw_batches(rng: random.Random, chunk: int, block: int, count: int) -> list[list[list[int]]]:
    lengths = _boundaries(chunk, block)
    docs = [[rng.randrange(1, 2000) for _ in range(rng.choice(lengths))] for _ in range(3)]
    served: list[list[int]] = []
    batches: list[list[list[int]]] = []
    while sum(len(b) for b in batches) < count:
        kind = rng.random()
        if served and kind < 0.25:
            prompt = list(rng.choice(served))  # comes back after others reused its blocks
        elif kind < 0.75:
            doc = rng.choice(docs)
            cut = rng.choice([len(doc)] + [n for n in lengths if n < len(doc)])
            tail = rng.choice([1, 17, 30, 61, rng.randrange(1, 200)])
            prompt = doc[:cut] + [rng.randrange(1, 2000) for _ in range(tail)]
        else:
            prompt = [rng.randrange(1, 2000) for _ in range(rng.choice(lengths))]
        prompt = prompt[:MAX_PROMPT]
        if rng.random() < 0.2 and served:
            other = list(rng.choice(served))[:MAX_PROMPT]
            batches.append([prompt, other])  # concurrent requests in one step
            served += [prompt, other]
        else:
            batches.append([prompt])
            served.append(prompt)
    return batches


def draw_case(seed: int, pages_only: bool, requests: int = 12, fixed: dict[str, Any] | None = None) -> Case:
    """The case of ``seed``; ``fixed`` settings replace the drawn ones (the workload is drawn alike)."""
    rng = random.Random(seed)
    settings = _draw_settings(rng, pages_only, dict(fixed or {}))
    block = settings["block_size"] or 128
    return Case(seed, settings, _draw_batches(rng, settings["chunk_size"], block, requests), fixed=dict(fixed or {}))


def allowed_hits(case: Case) -> list[int | None]:
    """Per request, the LMCache hit the stored chunks allow (whole chunks of earlier prompts, at most all but the
    prompt's last token), or None where a batch's requests could see each other's stores."""
    chunk = case.settings["chunk_size"]
    stored: set[tuple[int, ...]] = set()
    out: list[int | None] = []
    for batch in case.batches:
        for prompt in batch:
            best = 0
            for end in range(chunk, len(prompt) + 1, chunk):
                if tuple(prompt[:end]) in stored:
                    best = min(end, len(prompt) - 1)  # vLLM computes at least the prompt's last token
            out.append(best if len(batch) == 1 else None)
        for prompt in batch:
            stored.update(tuple(prompt[:end]) for end in range(chunk, len(prompt) + 1, chunk))
    return out
