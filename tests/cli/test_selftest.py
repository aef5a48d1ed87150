"""`lmcache-platforms selftest`: a real LMCacheEngine round trip, JSON last line, exit 0/1/2, clean exit."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from lmcache_platforms.cli import selftest

pytestmark = pytest.mark.slow

KEYS = {"layout", "bit_exact", "rows_checked", "chunks_stored", "chunks_hit", "transfer_groups",
        "launches_per_chunk", "backend"}


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The console script in a fresh process, which must exit by itself (LMCache closed cleanly)."""
    environ = {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", **env}
    return subprocess.run([sys.executable, "-m", "lmcache_platforms.cli.main", "selftest", *argv],
                          capture_output=True, text=True, env=environ, timeout=300)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def run_in_process(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    return selftest.run(parser.parse_args(argv))


def test_gemma3_is_bit_exact_and_the_process_exits() -> None:
    done = run_cli("--layout", "gemma3", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = last_json(done.stdout)
    assert set(result) >= KEYS
    assert result["layout"] == "gemma3" and result["bit_exact"] is True
    assert result["chunks_stored"] == result["chunks_hit"] == 4  # 300 tokens, 64-token chunks, whole only
    assert result["transfer_groups"] == result["launches_per_chunk"] == 2
    assert result["backend"] == "cpu"
    # 4 chunks: 64 full-attention rows + 32 window-tail rows, per plane (1 K + 1 V per layer, 1 and 5 layers)
    assert result["rows_checked"] == 4 * (64 * 2 + 32 * 2 * 5)


def test_triton_under_the_interpreter_in_exploded_mode() -> None:
    done = run_cli("--layout", "deepseek-v4-small", "--backend", "triton", "--mode", "exploded", "--json",
                   TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-2000:]
    result = last_json(done.stdout)
    assert result["bit_exact"] is True and result["backend"] == "triton"
    assert result["launches_per_chunk"] == 4


@pytest.mark.parametrize(("argv", "message"), [
    (["--layout", "no-such-layout"], "no such layout file or example"),
    (["--layout", "llama", "--backend", "ascend"], "kernel backend 'ascend' is unavailable"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv: list[str], message: str, capsys) -> None:
    assert run_in_process([*argv, "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmcache-platforms selftest:") and message in err[0]


def test_human_output_with_the_local_disk(tmp_path, capsys) -> None:
    assert run_in_process(["--layout", "llama", "--mode", "exploded", "--local-disk", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layout llama (exploded, backend cpu): bit-exact" in out
    assert "chunks stored 5, hit 5" in out  # one group: the partial last chunk is stored too
    assert any(tmp_path.iterdir())


def test_not_bit_exact_exits_1(monkeypatch, capsys) -> None:
    failed = {"layout": "x", "mode": "bundled", "bit_exact": False, "rows_checked": 3, "chunks_stored": 1,
              "chunks_hit": 1, "transfer_groups": 1, "launches_per_chunk": 1, "backend": "cpu",
              "problems": ["chunk [0, 64) layer 'l' plane 'k': 1 of 3 rows differ"]}
    monkeypatch.setattr(selftest, "selftest", lambda *args, **kwargs: failed)
    assert run_in_process(["--layout", "llama", "--json"]) == 1
    assert last_json(capsys.readouterr().out)["bit_exact"] is False
