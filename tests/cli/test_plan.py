"""`lmcache-platforms plan`: every shipped example plans in both modes; malformed files exit 2 with one line."""

from __future__ import annotations

import argparse
import json

import pytest

from lmcache_platforms.cli import plan
from lmcache_platforms.cli.main import main
from lmcache_platforms.layout.files import example_names, example_path


def run_plan(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    plan.add_arguments(parser)
    return plan.run(parser.parse_args(argv))


@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("name", example_names())
def test_every_example_plans_as_json(name, mode, capsys):
    assert run_plan(["--layout", name, "--mode", mode, "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["layout"] == name and summary["mode"] == mode
    groups = summary["transfer_groups"]
    assert summary["launches_per_chunk"] == len(groups)
    assert summary["chunk_bytes"] == sum(tg["bytes_per_chunk"] for tg in groups) > 0
    assert all(set(tg) == {"group", "planes", "layers", "rows_per_chunk", "bytes_per_chunk"} for tg in groups)
    assert isinstance(summary["skipped_planes"], int)


@pytest.mark.parametrize(("rows", "expected"), [
    ("tokens", [(0, 4, 32), (1, 2, 16), (1, 2, 16), (2, 2, 2)]),
    ("blocks", [(0, 4, 2), (1, 2, 4), (1, 2, 4), (2, 2, 1)]),  # a block row each: window 32 = 2 blocks
])
def test_deepseek_v4_small_plan_numbers(capsys, monkeypatch, rows, expected):
    monkeypatch.setenv("LMCACHE_PLATFORMS_CHUNK_ROWS", rows)
    assert run_plan(["--layout", "deepseek-v4-small", "--mode", "exploded", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(tg["group"], tg["planes"], tg["rows_per_chunk"]) for tg in summary["transfer_groups"]] == expected
    assert summary["skipped_planes"] == 4 and summary["skipped_groups"] == [3]
    assert summary["chunk_bytes"] == 32 * 584 * 4 + 16 * (584 + 132) * 2 + 2 * 584 * 2


def test_group_rules_from_the_command_line(capsys):
    assert run_plan(["--layout", "deepseek-v4-small", "--save-groups", "3", "--skip-groups", "2", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [tg["group"] for tg in summary["transfer_groups"]] == [0, 1, 3]


def test_mode_defaults_to_the_setting(capsys, monkeypatch):
    monkeypatch.setenv("LMCACHE_PLATFORMS_MODE", "exploded")
    assert run_plan(["--layout", "mla-int8", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["launches_per_chunk"] == 4


def test_table_output(capsys):
    assert run_plan(["--layout", "gemma3"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("layout gemma3: mode bundled, chunk 64 tokens")
    assert "launches per chunk: 2" in out and "chunk bytes: 114688" in out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"name": "x"}), "missing key 'chunk_size'"),
        (example_path("gemma3").read_text().replace('"bfloat16"', '"bfloat17"', 1), "unknown dtype 'bfloat17'"),
    ],
)
def test_malformed_files_exit_2_with_one_line(content, message, tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert run_plan(["--layout", str(path), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"lmcache-platforms plan: {path}: ") and message in lines[0]


def test_unknown_layout_name_exits_2(capsys):
    assert run_plan(["--layout", "no-such-model"]) == 2
    assert "no such layout file or example" in capsys.readouterr().err


def test_through_the_console_script_entry(tmp_path, capsys):
    assert main(["plan", "--layout", "llama8b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["chunk_bytes"] == 256 * 32 * 2 * 8 * 128 * 2
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["plan", "--layout", str(bad)]) == 2
    assert capsys.readouterr().err == f"lmcache-platforms plan: {bad}: layout: expected an object, got list\n"
