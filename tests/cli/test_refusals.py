"""Every user mistake of the front door refused before anything starts, with one line naming the option or key,
the value and what is allowed; the version and verbosity switches; SIGTERM and Ctrl-C ending what a command
started."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

import lmcache_platforms
from lmcache_platforms.cli import bench
from lmcache_platforms.cli.main import main
from lmcache_platforms.cli.workdir import run_in_workdir
from lmcache_platforms.config import PlatformSettings, connector_settings
from lmcache_platforms.layout.files import example_names
from tests.fork_server import run_module

REPO = Path(__file__).resolve().parents[2]


def _cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("LMCACHE_PLATFORMS_") and k != "LMCACHE_LOG_LEVEL"}  # in-process runs set it
    return run_module("lmcache_platforms.cli.main", list(argv), {**base, **env}, timeout=120)


def _refused(capsys, argv: list[str], line: str) -> None:
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert (out, err) == ("", line + "\n")


def test_version_and_no_activation_line_unless_asked() -> None:
    quiet = _cli("--version")
    assert (quiet.returncode, quiet.stdout) == (0, f"lmcache-platforms {lmcache_platforms.__version__}\n")
    assert "activated" not in quiet.stderr
    loud = _cli("-v", "plan", "--layout", "llama", "--json")
    assert loud.returncode == 0
    assert next(line for line in loud.stderr.splitlines() if "activated" in line).split(" INFO: ")[1].startswith(
        "lmcache_platforms activated: platform=cpu; patches: ")


@pytest.mark.parametrize(("env", "line"), [
    ({"LMCACHE_PLATFORMS_KERNEL_BACKEND": "fastest"},
     "lmcache-platforms plan: platforms.kernel_backend (LMCACHE_PLATFORMS_KERNEL_BACKEND) must be one of auto, "
     "torch, cpu, triton, ascend, got 'fastest'"),
    ({"LMCACHE_PLATFORMS_DEVICE": "tpu"},
     "lmcache-platforms plan: lmcache_platforms is not activated: PlatformError: unknown platform 'tpu'; known: npu, "
     "xpu, cuda, cpu"),
    ({"LMCACHE_PLATFORMS_LOAD_TIMEOUT_S": "true"},
     "lmcache-platforms plan: platforms.load_timeout_s must be a number of seconds, got 'true'"),
], ids=["kernel-backend", "device", "timeout"])
def test_a_bad_environment_is_refused_before_the_command(env: dict[str, str], line: str) -> None:
    result = _cli("plan", "--layout", "llama", **env)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr.splitlines()[-1] == line
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("argv", "line"), [
    (["plan", "--layout", "gemma3", "--skip-groups", "9"],
     "lmcache-platforms plan: platforms.skip_groups: '9' names no group of this model (a group index or spec class "
     "name; groups: group 0 (FullAttentionSpec), group 1 (SlidingWindowSpec))"),
    (["plan", "--layout", "gemma3", "--save-groups", "1", "--skip-groups", "1"],
     "lmcache-platforms plan: group 1 (SlidingWindowSpec) is in both platforms.save_groups and "
     "platforms.skip_groups: name it in one"),
    (["plan", "--layout", str(REPO / "docs")],
     f"lmcache-platforms plan: {REPO / 'docs'}: a folder, not a layout file (give a layout JSON file, or an "
     f"example: {', '.join(example_names())})"),
], ids=["skip-out-of-range", "save-and-skip", "folder"])
def test_plan_refuses(capsys, argv: list[str], line: str) -> None:
    _refused(capsys, argv, line)


@pytest.mark.parametrize(("argv", "line"), [
    (["--engine", "--layout", "gemma3"],
     "give one of --layout (a layout file or shipped example), --engine or --servers (got --layout and --engine)"),
    (["--engine", "--servers", "1"],
     "give one of --layout (a layout file or shipped example), --engine or --servers (got --engine and --servers)"),
    (["--layout", "gemma3", "--tiers", "cpu"],
     "--tiers is an option of --engine, not of --layout: it would be ignored"),
    (["--engine", "--rounds", "4"], "--rounds is an option of --servers, not of --engine: it would be ignored"),
    (["--servers", "1", "--repeats", "3"],
     "--repeats is an option of --layout, not of --servers: it would be ignored"),
    ([], "give one of --layout (a layout file or shipped example), --engine or --servers"),
], ids=["layout-engine", "engine-servers", "tiers", "rounds", "repeats", "none"])
def test_bench_refuses_options_of_another_benchmark(tmp_path, capsys, argv: list[str], line: str) -> None:
    workdir = tmp_path / "work"
    _refused(capsys, ["bench", *argv, *(["--workdir", str(workdir)] if "--layout" not in argv else [])],
             f"lmcache-platforms bench: {line}")
    assert not workdir.exists()  # nothing started: no engine, no weights written


def test_every_bench_option_belongs_to_a_benchmark() -> None:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = vars(parser.parse_args([]))
    assert set(args) - {"json", "bench_defaults"} == set(args["bench_defaults"])


def test_selftest_refuses_a_file_as_its_disk(tmp_path, capsys) -> None:
    disk = tmp_path / "disk"
    disk.write_text("mine")
    _refused(capsys, ["selftest", "--layout", "llama", "--local-disk", str(disk)],
             f"lmcache-platforms selftest: --local-disk {disk}: not a folder (LMCache keeps one file per chunk in "
             "it; give a folder, made if missing)")
    assert disk.read_text() == "mine"


def test_a_setting_at_the_yaml_top_level_is_refused_naming_where_it_goes(tmp_path, monkeypatch) -> None:
    from lmcache.v1.config import LMCacheEngineConfig

    path = tmp_path / "lmcache.yaml"
    path.write_text("chunk_size: 256\nplatforms.load_mode: async\n")
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    config = LMCacheEngineConfig.from_file(str(path))  # LMCache itself only warns and drops the key
    with pytest.raises(ValueError) as caught:
        connector_settings(config, None)
    assert str(caught.value) == (f"'platforms.load_mode' is at the top level of {path}, where LMCache ignores it: "
                                 "our settings go under extra_config (extra_config: {platforms.load_mode: async})")
    path.write_text("chunk_size: 256\nextra_config:\n  platforms.load_mode: async\n")
    config = LMCacheEngineConfig.from_file(str(path))
    assert connector_settings(config, None).load_mode == "async"


@pytest.mark.parametrize("key", ["platform.load_mode", "platfroms.load_mode"])
def test_a_key_a_typo_away_from_ours_is_refused(key: str) -> None:
    with pytest.raises(ValueError) as caught:
        PlatformSettings.load({key: "async"}, env={})
    assert str(caught.value) == (f"unknown setting {key!r} in LMCache's extra_config; "
                                 "did you mean 'platforms.load_mode'?")
    assert PlatformSettings.load({"other_plugin.mode": "x"}, env={}) == PlatformSettings()


def test_ctrl_c_removes_the_temporary_folder(tmp_path, monkeypatch) -> None:
    folder: list[Path] = []

    def body(path: Path) -> list[str]:
        folder.append(path)
        (path / "engine.log").write_text("started")
        raise KeyboardInterrupt

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(KeyboardInterrupt):
        run_in_workdir(None, False, "lmcache-platforms-test-", print, body)
    assert folder and not folder[0].exists()


def _children_of(folder: Path) -> list[int]:
    """Processes whose command line names ``folder`` (the engine passes a bench started there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if str(folder) in (entry / "cmdline").read_bytes().decode(errors="replace"):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.slow
def test_sigterm_ends_the_engine_child_and_removes_the_temporary_folder(tmp_path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LMCACHE_PLATFORMS_")}
    env.update(TMPDIR=str(tmp_path), PYTHONHASHSEED="0", LMCACHE_TRACK_USAGE="false")
    command = [sys.executable, "-m", "lmcache_platforms.cli.main", "bench", "--engine", "--model", "tiny",
               "--tiers", "cpu", "--tokens", "256", "--chunk-size", "256", "--requests", "1"]
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    deadline = time.monotonic() + 180
    folders: list[Path] = []
    while time.monotonic() < deadline and process.poll() is None:
        folders = list(tmp_path.glob("lmcache-platforms-bench-*"))
        if folders and _children_of(folders[0]):
            break
        time.sleep(0.5)
    assert folders and _children_of(folders[0]), "the bench never started its engine"
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 128 + signal.SIGTERM
    assert err.splitlines()[-1] == "lmcache-platforms bench: stopped by SIGTERM"
    assert "Traceback" not in err
    assert not folders[0].exists()
    time.sleep(1)
    assert _children_of(folders[0]) == []
