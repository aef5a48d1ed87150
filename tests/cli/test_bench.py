"""`lmcache-platforms bench`: the JSON line's fields, launches per chunk, upstream where it applies, bad input."""

from __future__ import annotations

import argparse
import json

import pytest

from lmcache_platforms.cli import bench
from lmcache_platforms.cli.main import main
from lmcache_platforms.kernels.cpu_backend import BACKEND as CPU
from lmcache_platforms.layout.files import load_layout_spec
from lmcache_platforms.tools.fixtures import plan

FIELDS = {"backend", "store_GBps", "load_GBps", "memcpy_GBps", "store_x_memcpy", "load_x_memcpy",
          "upstream_store_x_memcpy", "launches_per_chunk"}


def run_bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return bench.run(parser.parse_args(argv))


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.parametrize("name, upstream", [("llama", True), ("gemma3", False), ("deepseek-v4-small", False)])
def test_json_result(name, upstream, capsys):
    assert run_bench(["--layout", name, "--chunks", "2", "--repeats", "1", "--json"]) == 0
    result = last_json(capsys)
    assert set(result) >= FIELDS
    assert result["backend"] == ("cpu" if CPU.availability()[0] else "torch")
    assert result["launches_per_chunk"] == plan(load_layout_spec(name)).launches_per_chunk
    assert result["chunks"] == 2
    assert result["bytes"] == 2 * plan(load_layout_spec(name)).chunk_bytes
    for key in ("store_GBps", "load_GBps", "memcpy_GBps", "store_x_memcpy", "load_x_memcpy", "checksum_GBps",
                "store_checksummed_x_memcpy", "load_checksummed_x_memcpy"):
        assert result[key] > 0
    # The checksummed store and load do the same moves plus the checksum (a noisy machine may still reorder them).
    assert result["checksum_store_cost"] > -1 and result["checksum_load_cost"] > -1
    assert result["checksum_store_cost_per_object"] > -1 and result["checksum_load_cost_per_object"] > -1
    assert result["checksum_load_floor"] > -1  # contiguous whole-stripe rows, the same objects' count and size
    assert (result["upstream_store_x_memcpy"] is not None) is upstream
    assert (result["upstream_format"] == "NL_X_NB_TWO_BS_NH_HS") is upstream
    # The path through pinned host memory, with either way of making the checksum, exists only where the KV
    # cache is on an accelerator.
    assert {k: v for k, v in result.items() if "pinned" in k or "host" in k} == dict.fromkeys(
        ("pinned_d2h_GBps", "pinned_h2d_GBps", "store_to_host_GBps", "load_from_host_GBps",
         "store_to_host_x_pinned_copy", "load_from_host_x_pinned_copy", "store_to_host_device_checksum_cost",
         "load_from_host_device_checksum_cost", "store_to_host_host_checksum_cost",
         "load_from_host_host_checksum_cost"))
    # So does the GPU time alone (CUDA graph replay).
    assert {k: v for k, v in result.items() if k.startswith("gpu_")} == dict.fromkeys(
        ("gpu_store_x_device_copy", "gpu_load_x_device_copy"))


def test_explicit_backend_and_mode(capsys):
    assert run_bench(["--layout", "mla-int8", "--backend", "torch", "--mode", "exploded", "--chunks", "1",
                      "--repeats", "1", "--json"]) == 0
    result = last_json(capsys)
    assert result["backend"] == "torch" and result["mode"] == "exploded"
    assert result["launches_per_chunk"] == plan(load_layout_spec("mla-int8"), "exploded").launches_per_chunk


def test_backend_from_settings_environment(monkeypatch, capsys):
    monkeypatch.setenv("LMCACHE_PLATFORMS_KERNEL_BACKEND", "torch")
    assert run_bench(["--layout", "llama", "--chunks", "1", "--repeats", "1", "--json"]) == 0
    assert last_json(capsys)["backend"] == "torch"


def test_readable_output_through_the_console_script(capsys):
    assert main(["bench", "--layout", "llama", "--chunks", "1", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "store_x_memcpy" in out and "launches_per_chunk" in out


@pytest.mark.parametrize("argv, message", [
    (["--layout", "no-such-layout"], "no-such-layout: no such layout file or example"),
    (["--layout", "llama", "--backend", "fastest"], "unknown kernel backend 'fastest'"),
    (["--layout", "llama", "--repeats", "0"], "--repeats must be at least 1, got 0"),
    (["--layout", "llama", "--chunks", "0"], "--chunks must be at least 1, got 0"),
    (["--servers", "1,0"], "--servers takes a comma list of server counts of 1 or more, got '1,0'"),
    (["--servers", "two"], "--servers takes a comma list of server counts of 1 or more, got 'two'"),
    (["--servers", "2", "--rounds", "1"],
     "--servers needs --tokens >= --chunk-size, --groups >= 1, --rounds >= 2 and --concurrency >= 1"),
    (["--servers", "2", "--concurrency", "0"],
     "--servers needs --tokens >= --chunk-size, --groups >= 1, --rounds >= 2 and --concurrency >= 1"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert run_bench([*argv, "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], captured.err


def test_unavailable_backend_is_refused(capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert run_bench(["--layout", "llama", "--backend", "triton", "--json"]) == 2
    assert "kernel backend 'triton' is unavailable" in capsys.readouterr().err


def test_malformed_layout_file(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text('{"name": "bad", "chunk_size": 16}')
    assert run_bench(["--layout", str(path), "--json"]) == 2
    assert str(path) in capsys.readouterr().err
