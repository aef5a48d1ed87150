"""Our connector's statistics on a real ``vllm serve``'s ``/metrics``, served by two API server processes (vLLM hands
each step's statistics to one of them and sums their samples): after a cold and a warm pass of two prompts
(vLLM's prefix cache off, so the repeats load from LMCache), the counters are exact: lookups, hit tokens, chunks
and bytes stored and loaded (bytes = chunks x the chunk object's bytes: the model's layout, then the checksum
trailer's column; per KV-cache group, the group's own bytes; per tier, the objects read from it), one load and
store time observed per request; nothing is counted as a failed load."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.client import Sampling, run_requests
from lmcache_platforms.tools.demo.model import TINY_DENSE_MODEL, ensure_model
from lmcache_platforms.tools.demo.runners import Resources
from lmcache_platforms.tools.demo.server import VllmServer, http_get
from lmcache_platforms.tools.demo.server_pass import serve_args
from lmcache_platforms.tools.demo.tokenizer import text_of
from tests.serving.test_upstream_names import CHUNK, LENGTHS, _requests, cpu_tier_env

pytestmark = pytest.mark.slow

PREFIX = "vllm:lmcache_platforms_"
# The dense tiny model: 4 layers x (K, V) x 2 KV heads x 64 dims x bf16, per token.
BYTES_PER_TOKEN = 4 * 2 * 2 * 64 * 2


def scrape(base_url: str) -> dict[str, float]:
    """Our families' samples (summed over label sets) by sample name, without the ``_created`` timestamps and
    histogram buckets."""
    found: dict[str, float] = {}
    for line in http_get(f"{base_url}/metrics").splitlines():
        match = re.match(rf"^({re.escape(PREFIX)}\w+)(?:\{{[^}}]*\}})? (\S+)$", line)
        if match and not match.group(1).endswith(("_created", "_bucket")):
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def scrape_by_label(base_url: str, family: str, label: str) -> dict[str, float]:
    """One family's samples by the value of one of their labels."""
    found: dict[str, float] = {}
    for line in http_get(f"{base_url}/metrics").splitlines():
        match = re.match(rf'^{re.escape(PREFIX + family)}\{{[^}}]*\b{label}="([^"]*)"[^}}]*\}} (\S+)$', line)
        if match:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(2))
    return found


def test_metrics_count_exactly_what_moved(tmp_path: Path) -> None:
    requests = _requests(TINY_DENSE_MODEL.vocab_size)
    prompts = [(r.name, text_of(r.tokens), len(r.tokens)) for r in requests]
    server = VllmServer.for_model(ensure_model(TINY_DENSE_MODEL),
                                  {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both"},
                                  [*serve_args(32, 1024), "--no-enable-prefix-caching", "--api-server-count", "2"],
                                  tmp_path / "server.log",
                                  Resources.available(), cpu_tier_env(tmp_path))
    with server:
        before = scrape(server.base_url)
        cold = run_requests(server.base_url, prompts, Sampling(max_tokens=8))
        warm = run_requests(server.base_url, prompts, Sampling(max_tokens=8))
        after = scrape(server.base_url)
        per_group = {direction: scrape_by_label(server.base_url, f"group_bytes_{direction}_total", "kv_group")
                     for direction in ("stored", "loaded")}
        per_tier = scrape_by_label(server.base_url, "tier_bytes_read_total", "tier")
    hits = [n // CHUNK * CHUNK for n in LENGTHS]  # whole chunks; vLLM computes the last token itself
    assert [r["lmcache_hit_tokens"] for r in cold + warm] == [0, 0, *hits]
    chunks = sum(n // CHUNK for n in LENGTHS)  # only whole chunks are saved (LMCache's save_unfull_chunk: false)
    # Each chunk object: its KV, then the checksum trailer padded to one more uint8 "token" column.
    chunk_bytes = CHUNK * BYTES_PER_TOKEN + CHUNK
    assert set(before.values()) == {0.0}, before
    assert {name.removeprefix(PREFIX): value for name, value in after.items()} == {
        "lookups_total": 4, "hit_tokens_total": sum(hits),
        "chunks_stored_total": chunks, "bytes_stored_total": chunks * chunk_bytes,
        "chunks_loaded_total": chunks, "bytes_loaded_total": chunks * chunk_bytes,
        "group_bytes_stored_total": chunks * CHUNK * BYTES_PER_TOKEN,
        "group_bytes_loaded_total": chunks * CHUNK * BYTES_PER_TOKEN,
        "tier_bytes_read_total": chunks * chunk_bytes,
        "loads_failed_total": 0, "resets_total": 0,
        "remote_lookups_timed_out_total": 0, "remote_lookups_skipped_total": 0,
        "store_seconds_count": 2, "load_seconds_count": 2,
        "store_seconds_sum": after[f"{PREFIX}store_seconds_sum"],
        "load_seconds_sum": after[f"{PREFIX}load_seconds_sum"],
    }
    assert 0 < after[f"{PREFIX}store_seconds_sum"] < 10 and 0 < after[f"{PREFIX}load_seconds_sum"] < 10
    # One KV-cache group: its bytes are the chunks' KV, without the trailer's column.
    kv_bytes = chunks * CHUNK * BYTES_PER_TOKEN
    assert per_group == {"stored": {"0": kv_bytes}, "loaded": {"0": kv_bytes}}
    assert per_tier == {"LocalCPUBackend": chunks * chunk_bytes}  # the only tier: every object read from it
