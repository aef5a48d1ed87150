"""`lmcache-platforms bench --engine`: the store and load calls' lines and our per-request lines are paired into
exact byte counts and costs, and a real run through in-process vLLM engines stores every prompt, hits every prompt
and reads only what the windows need."""

from __future__ import annotations

import argparse
import json

import pytest

from lmcache_platforms.cli import bench
from lmcache_platforms.tools.demo.model import TINY_MODEL
from lmcache_platforms.tools.engine_bench import _row_or_error, kv_bytes_per_token, parse_lines

LOG = """\
lmcache_platforms INFO: request 0: stored 4 objects (whole: 4) for 512 of 512 tokens, 655360 bytes written, 1.500 ms
lmcache_platforms INFO: request 0: stored tokens [0, 512) in LMCache, 655360 bytes written
lmcache_platforms INFO: request 1: stored 8 objects (all: 4, reach64: 4) for 512 of 512 tokens, 655360 bytes \
written, 3.500 ms
lmcache_platforms INFO: request 1: stored tokens [0, 512) in LMCache, 655360 bytes written
lmcache_platforms INFO: request 1: read 5 objects (all: 4, reach64: 1) for 511 of 511 tokens, 360448 bytes \
written, 0.750 ms
lmcache_platforms INFO: request 1: loaded tokens [0, 511) from LMCache, 360448 bytes read
"""


def test_each_request_pairs_our_exact_bytes_with_the_cost_of_its_call() -> None:
    stored = parse_lines(LOG, "store", skip=1)
    assert (stored.tokens, stored.bytes, stored.seconds) == ([512], [655360.0], [pytest.approx(0.0035)])
    loaded = parse_lines(LOG, "load")
    assert (loaded.tokens, loaded.bytes, loaded.seconds) == ([511], [360448.0], [pytest.approx(0.00075)])
    assert loaded.gbps == pytest.approx(360448 / 0.00075 / 1e9)


def test_lmcache_calls_without_our_line_count_towards_none() -> None:
    unlogged = LOG.replace("stored tokens [0, 512) in LMCache, 655360 bytes written", "something else")
    assert parse_lines(unlogged, "store").tokens == []


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


@pytest.mark.parametrize(("argv", "message"), [
    ([], "give one of --layout (a layout file or shipped example), --engine or --servers"),
    (["--engine", "--tokens", "64"], "--engine needs --tokens >= --chunk-size and --requests >= 1, got 64, 256, 3"),
    (["--engine", "--tiers", "cpu,tape"],
     "--tiers takes a comma list of cpu, disk, fs, redis, redis-cluster, vllm, got 'cpu,tape'"),
    (["--engine", "--model", "tiny", "--full-attention-every", "5"], "--full-attention-every must be 1 to 4, got 5"),
    (["--engine", "--modes", "paged,paged"], "--modes takes a comma list of paged, layerwise (each once), got "
                                             "'paged,paged'"),
])
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys, tmp_path) -> None:
    assert run([*argv, "--workdir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"lmcache-platforms bench: {message}"]


def test_a_tier_that_fails_is_a_row_naming_its_error() -> None:
    def store_gone() -> dict:
        raise OSError("store gone")

    assert _row_or_error("redis", "paged", store_gone) == {"tier": "redis", "mode": "paged",
                                                           "error": "OSError: store gone"}
    assert _row_or_error("cpu", "paged", lambda: {"tier": "cpu", "mode": "paged"}) == {"tier": "cpu",
                                                                                        "mode": "paged"}


@pytest.mark.slow
def test_a_real_engine_stores_and_reloads_every_prompt_reading_only_the_windows(capsys, tmp_path) -> None:
    tokens = 512
    assert run(["--engine", "--model", "tiny", "--tokens", str(tokens), "--requests", "2", "--chunk-size", "128",
                "--tiers", "cpu,vllm", "--modes", "paged,layerwise", "--kv-events", "--checksum-cost",
                "--idle-steps", "8", "--workdir", str(tmp_path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["kv_events"] is True
    row, layerwise, vllm = result["tiers"]
    # vLLM's own prefix cache, each prompt asked twice: its whole 32-token blocks before the last token are a hit.
    assert (vllm["tier"], vllm["mode"], vllm["hit_tokens"]) == ("vllm", "prefix cache", [480, 480])
    for tier in (row, layerwise):
        assert tier["warm_ttft_x_vllm_hit"] == tier["warm_ttft_s"] / vllm["warm_ttft_s"]
    assert (row["tier"], row["mode"], layerwise["tier"], layerwise["mode"]) == ("cpu", "paged", "cpu", "layerwise")
    assert "error" not in row and "error" not in layerwise, result
    # The layerwise mode moves the same chunk objects: the same bytes per request, the same hits.
    for key in ("hit_tokens", "stored_bytes_per_request", "read_bytes_per_request"):
        assert layerwise[key] == row[key], key
    assert isinstance(layerwise["load_hidden"], float) and "load_hidden" not in row
    assert row["hit_tokens"] == [tokens - 1, tokens - 1]  # vLLM computes the last prompt token itself
    # --kv-events: every stored prompt was published whole (a router following the events holds all of it)
    assert row["published_tokens"] == layerwise["published_tokens"] == [tokens, tokens]
    # One layer attends fully; 3 slide over 64 tokens, so each 128-token chunk keeps their last 64 rows, and a
    # hit reads the full layer's 4 chunks and only the last chunk of the sliding ones.
    per_row = kv_bytes_per_token(TINY_MODEL) // TINY_MODEL.num_layers
    # Each object (4 chunks x 2 parts stored; 4 full parts and 1 window part read) adds its checksum trailer,
    # padded to one uint8 "token" column of the 128-token chunk.
    assert row["stored_bytes_per_request"] == per_row * (tokens + 3 * 4 * 64) + 8 * 128
    assert row["read_bytes_per_request"] == per_row * (tokens + 3 * 64) + 5 * 128
    assert row["store_x_memcpy"] > 0 and row["load_x_memcpy"] > 0
    # The pass's memory: an engine holds far more than 100 MiB after its warm-up; the requests' growth is known.
    assert row["rss_after_warmup_MiB"] > 100 and isinstance(row["rss_growth_MiB"], float)
    # --checksum-cost: both modes hash every store and check every load of host objects, so each has the figures.
    for tier in (row, layerwise):
        for direction in ("store", "load"):
            assert tier[f"checksum_{direction}_python_ms"] > 0, tier
            assert all(isinstance(tier[f"checksum_{direction}_{name}"], float) for name in ("ms", "share")), tier
    assert not any(key.startswith("checksum_") for key in vllm)
    # --idle-steps: 8 tokens decoded with nothing to move, one scheduler step each, every step's connector calls
    # timed (each layer's save among them) and a small part of the step.
    for tier in (row, layerwise):
        assert (tier["idle_steps"], tier["idle_tokens"]) == (8, 8), tier
        assert 0 < tier["idle_connector_ms_per_step"] < tier["idle_step_ms"], tier
        assert tier["idle_connector_share"] == pytest.approx(tier["idle_connector_ms_per_step"]
                                                             / tier["idle_step_ms"]), tier
        for method in ("build_connector_meta", "save_kv_layer", "get_transfer_results"):
            assert tier[f"idle_ms_per_step_{method}"] > 0, (method, tier)
    assert not any(key.startswith("idle_") for key in vllm)
    # Where the warm TTFT went: every row has the wait and the prefill; ours, timed, the lookup inside the wait.
    for tier in (row, layerwise, vllm):
        assert tier["warm_queued_ms"] >= 0 and tier["warm_prefill_ms"] > 0, tier
    for tier in (row, layerwise):
        assert 0 < tier["warm_lookup_ms"] <= tier["warm_connector_ms"], tier
    assert "warm_lookup_ms" not in vllm
