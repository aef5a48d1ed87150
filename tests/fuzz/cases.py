"""A fuzz case from a seed: settings drawn from every dimension docs/support-matrix.md claims, and a workload that goes
looking for stale rows (prompt lengths at and around chunk, block and window boundaries, shared prefixes and
branches, prompts that come back after others reused their blocks, concurrent batches).

A case is plain data (``Case.spec``), so a failure replays from its seed alone. Settings that cannot go
together are redrawn as the product requires them: the upstream names turn vLLM's hybrid manager off; a
recurrent hybrid (``qwen3-next``, ``lfm2``) runs under our name in vLLM's align mode (hybrid manager and prefix
caching on, vLLM's own block size) with room for its states; prefill/decode roles (``roles=split``) share a
store both processes reach (``fs``, ``redis``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

CONNECTORS = ("LMCachePlatformsConnector", "LMCacheConnectorV1", "LMCacheConnectorV1Dynamic")
DIMENSIONS: dict[str, tuple[Any, ...]] = {
    "model": ("hybrid", "dense", "qwen3-next", "lfm2"),
    "connector": CONNECTORS,
    "hma": (True, False),
    "chunk_size": (128, 256),
    "block_size": (None, 32, 64),
    "chunk_parts": ("window", "whole"),
    "chunk_rows": ("blocks", "tokens"),
    "load_mode": ("sync", "async"),
    "layerwise": (False, True),
    "tier": ("cpu", "disk", "fs", "redis"),
    "roles": ("both", "split"),
    "prefix_caching": (False, True),
    "kv_cache_dtype": ("auto", "fp8"),
    "kv_cache": ("roomy", "tight"),
}
RECURRENT = ("qwen3-next", "lfm2")
# Models whose recurrent state vLLM's CPU kernels resume in other arithmetic than a prefill computes it, and the
# top-logit drift (bf16 units in the last place) that allows: a request resumed from a state (LMCache's, or vLLM's
# own prefix cache's) rounds its logits otherwise than a cold one, without poisoned blocks too (LFM2's short
# convolution: up to 4 seen; Qwen3-Next's GDN resumes bit for bit).
RESUMES_OTHERWISE = {"lfm2": 5.0}
SHARED_TIERS = ("fs", "redis")
WINDOW = 96  # the hybrid model's sliding window: not a multiple of any block size drawn
ABORTED = 0.1  # the share of batches whose last request the client aborts mid-load (and, of the rest, waiting)
TIGHT_LEN = 1536  # the longest prompt and its answer, in whole blocks of every size drawn
TIGHT_BUDGET = 256  # tokens per step under a tight cache: prefills go in chunks, so a batch outgrows the cache
MAX_PROMPT = 1500
MAX_TOKENS = 16


@dataclass
class Case:
    seed: int
    settings: dict[str, Any]
    batches: list[list[list[int]]]
    plant: str | None = None
    aborted: list[int] = field(default_factory=list)  # batches whose last request the client aborts mid-load
    # Batches whose last request the client aborts once it was looked up but left waiting for blocks.
    aborted_waiting: list[int] = field(default_factory=list)
    poison: bool = True
    notes: list[str] = field(default_factory=list)
    incomparable: int = 0
    hit_tokens: int = 0
    preemptions: int = 0
    waiting_aborts: int = 0  # requests the passes aborted while looked up and waiting
    one_token: int = 0
    drift: float = 0.0
    fixed: dict[str, Any] = field(default_factory=dict)

    def client_aborts(self, number: int) -> bool:
        """Whether the client aborts batch ``number``'s last request (it has no answer to compare)."""
        return number in self.aborted or number in self.aborted_waiting

    @property
    def requests(self) -> int:
        return sum(len(b) for b in self.batches)

    def effective_block(self) -> int:
        return self.settings["block_size"] or 128

    @property
    def recurrent(self) -> bool:
        return self.settings["model"] in RECURRENT

    def spec(self, model_dir: str, reference: bool, workdir: str, role: str = "kv_both",
             redis_url: str | None = None) -> dict[str, Any]:
        """One engine pass: the reference (stores nothing), or the case in ``role`` (a split case runs a
        ``kv_producer`` pass, then a ``kv_consumer`` pass on the same store)."""
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
        else:  # a shared store (a folder, or a Redis server of the case's own) behind a small CPU tier that evicts
            url = redis_url if s["tier"] == "redis" else f"fs://localhost:0{workdir}/fs"
            extra.update({"lmcache.local_cpu": True, "lmcache.max_local_cpu_size": 0.02,
                          "lmcache.remote_url": url, "lmcache.remote_serde": "naive"})
        engine: dict[str, Any] = {
            "max_model_len": 2048,
            "kv_cache_dtype": s["kv_cache_dtype"],
            "enable_prefix_caching": s["prefix_caching"],
            "disable_hybrid_kv_cache_manager": not s["hma"],
        }
        if self.recurrent:
            engine["mamba_cache_mode"] = "align"
        if s["block_size"]:
            engine["block_size"] = s["block_size"]
        if s["kv_cache"] == "tight":
            # Room for one longest request and a block more, filled in steps of a few hundred tokens, requests
            # admitted when their next step fits (not their whole prompt, vLLM's default): two long requests of a
            # batch outgrow the cache together, and vLLM preempts the later one (recomputed when there is room
            # again), whose blocks a load may have written.
            block = self.effective_block()
            engine["max_model_len"] = TIGHT_LEN
            blocks = -(-TIGHT_LEN // block)  # the full-attention group's blocks for one longest request
            if s["model"] == "hybrid" and s["hma"]:  # and each of its two sliding-window groups', as vLLM counts them
                blocks += 2 * (-(-(WINDOW - 1 + TIGHT_BUDGET) // block) + 1)
            engine["num_gpu_blocks_override"] = blocks + 1
            engine["max_num_batched_tokens"] = TIGHT_BUDGET
            engine["scheduler_reserve_full_isl"] = False
        return {"model_dir": model_dir, "connector": s["connector"], "role": role, "extra_config": extra,
                "engine": engine, "reference": reference, "max_tokens": MAX_TOKENS, "batches": self.batches,
                "aborted": self.aborted, "aborted_waiting": self.aborted_waiting,
                # Align mode needs vLLM's prefix cache on; forgotten after each batch, the next batch's hits
                # come from LMCache, as in a fresh server.
                "forget": self.recurrent,
                "plant": None if reference else self.plant}


def _draw_settings(rng: random.Random, pages_only: bool, fp8_cache: bool, fixed: dict[str, Any]) -> dict[str, Any]:
    s = {name: rng.choice(values) for name, values in DIMENSIONS.items()}
    s.update(fixed)
    if not fp8_cache:
        s["kv_cache_dtype"] = "auto"  # vLLM's CPU attention keeps no fp8 cache without AVX-512 or AMX
    if s["model"] in RECURRENT:  # align mode: hybrid manager and prefix caching on, vLLM's block, room for states
        s.update(connector="LMCachePlatformsConnector", hma=True, prefix_caching=True, block_size=None,
                 kv_cache="roomy")
    if s["connector"] != "LMCachePlatformsConnector":
        s["hma"] = False  # neither upstream name declares HMA support: vLLM turns the hybrid manager off
    if s["roles"] == "split" and s["tier"] not in SHARED_TIERS:
        s["tier"] = rng.choice(SHARED_TIERS)  # producer and consumer are two processes: a store both reach
    if pages_only:
        s["chunk_rows"] = "blocks"  # this CPU's AMX cache moves only whole block pages
    return s


def _boundaries(chunk: int, block: int) -> list[int]:
    """Lengths a stale or missing row would hide at: chunk, block and window edges, one either side."""
    edges = {chunk * k for k in range(1, 6)} | {block * k for k in range(1, 8)} | {WINDOW, chunk + WINDOW}
    return sorted({e + d for e in edges for d in (-1, 0, 1) if 1 < e + d <= MAX_PROMPT - 100})


def _draw_batches(rng: random.Random, chunk: int, block: int, count: int, tight: bool) -> list[list[list[int]]]:
    """Single requests and concurrent batches (more and wider ones under a tight cache, which they outgrow)."""
    width, concurrent = (4, 0.5) if tight else (2, 0.2)
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
        if rng.random() < concurrent and served:
            others = [list(rng.choice(served))[:MAX_PROMPT] for _ in range(rng.randrange(1, width))]
            batches.append([prompt, *others])  # concurrent requests in one step
            served += [prompt, *others]
        else:
            batches.append([prompt])
            served.append(prompt)
    return batches


def draw_case(seed: int, pages_only: bool, requests: int = 12, fixed: dict[str, Any] | None = None,
              fp8_cache: bool = True) -> Case:
    """The case of ``seed`` on a CPU whose vLLM keeps an fp8 cache or not (``fp8_cache``); ``fixed`` settings
    replace the drawn ones (the workload is drawn alike)."""
    rng = random.Random(seed)
    settings = _draw_settings(rng, pages_only, fp8_cache, dict(fixed or {}))
    block = settings["block_size"] or 128
    tight = settings["kv_cache"] == "tight"
    batches = _draw_batches(rng, settings["chunk_size"], block, requests, tight)
    aborted = [n for n in range(len(batches)) if rng.random() < ABORTED]
    # Drawn after everything else, so that the earlier draws of a seed are those its replays always had.
    waiting = [n for n in range(len(batches)) if n not in aborted and rng.random() < ABORTED]
    return Case(seed, settings, batches, aborted=aborted, aborted_waiting=waiting, fixed=dict(fixed or {}))


def allowed_hits(case: Case, prestored: bool = False, chunk: int | None = None) -> list[tuple[int, int] | None]:
    """Per request, the range of LMCache hits the stored chunks allow: whole chunks of earlier prompts, at most
    all but the prompt's last token, the low end without the chunks of aborted requests (which may or may not
    have been stored), the high end with them; None where a batch's requests could see each other's stores.
    ``prestored``: every prompt's chunks were stored before the pass (a consumer after its producer). ``chunk``:
    the chunk size the pass ran with, where the connector raised the drawn one (a recurrent model's vLLM block)."""
    chunk = chunk or case.settings["chunk_size"]

    def chunks(prompt: list[int]) -> set[tuple[int, ...]]:
        return {tuple(prompt[:end]) for end in range(chunk, len(prompt) + 1, chunk)}

    def hit(prompt: list[int], stored: set[tuple[int, ...]]) -> int:
        ends = [end for end in range(chunk, len(prompt) + 1, chunk) if tuple(prompt[:end]) in stored]
        return min(max(ends), len(prompt) - 1) if ends else 0  # vLLM computes at least the last token

    sure: set[tuple[int, ...]] = set()
    maybe: set[tuple[int, ...]] = set()
    if prestored:
        sure = set().union(*(chunks(p) for b in case.batches for p in b))
    out: list[tuple[int, int] | None] = []
    for number, batch in enumerate(case.batches):
        for prompt in batch:
            span = (hit(prompt, sure), hit(prompt, sure | maybe))
            out.append(span if len(batch) == 1 or prestored else None)
        for i, prompt in enumerate(batch):
            (maybe if case.client_aborts(number) and i == len(batch) - 1 else sure).update(chunks(prompt))
    return out
