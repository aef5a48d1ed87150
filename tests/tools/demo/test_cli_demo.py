"""`lmcache-platforms demo` refuses bad input with one line on stderr and exit 2, before starting anything."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from lmcache_platforms.cli import demo
from lmcache_platforms.tools.demo.scenario import DemoOptions


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    return demo.run(parser.parse_args(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--chunk-size", "100"], "--chunk-size must be a positive multiple of 32, got 100"),
        (["--chunk-size", "0"], "--chunk-size must be a positive multiple of 32, got 0"),
        (["--cores", "a-b"], "--cores must look like 0-1 or 0,2, got 'a-b'"),
        (["--cores", "100000"], "--cores 100000 is not within the usable CPUs"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    assert _run(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert len(err.strip().splitlines()) == 1


def test_cores_ranges_and_lists() -> None:
    assert demo._parse_cores("0-2,5") == (0, 1, 2, 5)
    assert demo._parse_cores("1") == (1,)


@pytest.mark.parametrize(("argv", "kept"), [([], False), (["--keep-store"], True)])
def test_keep_store_reaches_the_demo_options(argv: list[str], kept: bool, tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[DemoOptions] = []

    def record(options: DemoOptions, _progress: object, _as_json: bool) -> list[str]:
        seen.append(options)
        return []

    monkeypatch.setattr(demo, "_run_and_report", record)
    assert _run([*argv, "--workdir", str(tmp_path)]) == 0
    assert [(o.keep_store, o.workdir) for o in seen] == [(kept, tmp_path)]
