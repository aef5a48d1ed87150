"""The commands' human tables: aligned columns, no field that is None everywhere, ``-`` for a missing cell;
``bench``'s three outputs as tables (``--json`` keeps the objects scripts read)."""

from __future__ import annotations

import argparse

from lmcache_platforms.cli import bench
from lmcache_platforms.cli.bench_output import engine_table, servers_table
from lmcache_platforms.cli.tables import cell, fields_table, key_values, rows_table


def test_cells() -> None:
    assert [cell(v) for v in (None, True, False, 1.23456, 7, [512, 511], "cpu")] == [
        "-", "yes", "no", "1.235", "7", "512,511", "cpu"]


def test_rows_table_aligns_numbers_right_and_leaves_out_fields_none_everywhere() -> None:
    rows = [{"servers": 1, "requests_per_s": 1.5, "gpu_x": None, "note": "warm"},
            {"servers": 12, "requests_per_s": None, "gpu_x": None, "note": "cold"}]
    assert rows_table(rows) == "\n".join([
        "servers  requests_per_s  note",
        "      1           1.500  warm",
        "     12               -  cold",
    ])


def test_fields_table_has_a_column_per_row() -> None:
    columns = {"cpu (paged)": {"tier": "cpu", "load_GBps": 2.0, "pinned_GBps": None, "hit_tokens": [255, 255]},
               "redis (paged)": {"tier": "redis", "load_GBps": 0.25, "pinned_GBps": None}}
    assert fields_table(columns, skip=("tier",)) == "\n".join([
        "            cpu (paged)  redis (paged)",
        "load_GBps         2.000          0.250",
        "hit_tokens      255,255              -",
    ])


def test_key_values() -> None:
    assert key_values({"store_GBps": 3.14159, "gpu_store_x_device_copy": None, "launches_per_chunk": 2}) == (
        "store_GBps          3.142\nlaunches_per_chunk      2")


def test_engine_table_one_column_per_tier_and_failures_named_below() -> None:
    result = {"model": "tiny", "tokens": 512, "requests": 2, "chunk_size": 128, "cores": "0-1", "kv_events": True,
              "tiers": [
                  {"tier": "cpu", "mode": "paged", "store_GBps": 1.25, "load_GBps": 2.5, "hit_tokens": [511, 511],
                   "rss_growth_MiB": None},
                  {"tier": "cpu", "mode": "layerwise", "store_GBps": 1.0, "load_GBps": 2.0, "hit_tokens": [511, 511],
                   "rss_growth_MiB": None, "load_hidden": 0.5},
                  {"tier": "redis", "mode": "paged", "error": "OSError: store gone"},
              ]}
    assert engine_table(result) == "\n".join([
        "tiny, 512 tokens x 2 prompts, chunk 128, cores 0-1, KV-cache events published",
        "             cpu (paged)  cpu (layerwise)",
        "store_GBps         1.250            1.000",
        "load_GBps          2.500            2.000",
        "hit_tokens       511,511          511,511",
        "load_hidden            -            0.500",
        "tier redis (paged) failed: OSError: store gone",
    ])


def test_servers_table_one_line_per_server_count() -> None:
    result = {"model": "tiny", "prefix_tokens": 1024, "suffix_tokens": 128, "groups": 6, "rounds": 3,
              "chunk_size": 256, "concurrency": 1, "cores": 2,
              "rows": [{"servers": 1, "warm_requests": 12, "errors": 0, "requests_per_s": 2.0, "hit_rate": 0.875},
                       {"servers": 2, "warm_requests": 12, "errors": 1, "requests_per_s": 3.5, "hit_rate": None}]}
    assert servers_table(result) == "\n".join([
        "tiny, 1024-token prefixes + 128, 6 prefixes x 3 rounds, chunk 256, 1 in flight per server, cores 2",
        "servers  warm_requests  errors  requests_per_s  hit_rate",
        "      1             12       0           2.000     0.875",
        "      2             12       1           3.500         -",
    ])


def test_bench_layout_prints_a_table_without_none(capsys) -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert bench.run(parser.parse_args(["--layout", "llama", "--chunks", "1", "--repeats", "1"])) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("layout llama, bundled, 1 chunks (131072 bytes) on cpu, ")
    assert lines[0].endswith("; upstream LMCache's path as NL_X_NB_TWO_BS_NH_HS")
    figures = dict(line.split() for line in lines[1:])
    assert "None" not in figures.values() and "-" not in figures.values()
    assert figures["launches_per_chunk"] == "1" and "store_x_memcpy" in figures
    assert not any(key.startswith(("gpu_", "pinned_")) for key in figures)  # measured on accelerators only
    assert len({len(line) for line in lines[1:]}) == 1  # one value column, right-aligned
