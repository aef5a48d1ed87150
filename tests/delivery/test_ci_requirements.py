"""Components the suite verifies must not silently go missing in CI: a missing redis-server fails
``scripts/test_services.sh`` and the Redis tests under ``CI=true``, and a wrong upstream pin fails the
delivery tests while only a registry pip cannot connect to skips them (and fails under CI). ``.ci/run`` is
``make test`` with ``CI=true``, and ``make test`` gives pytest the same environment wherever it runs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests import ci
from tests.delivery.upstream import _download, _pip_download, registry_unreachable
from tests.fork_server import run_module

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def path_without_redis(tmp_path: Path) -> str:
    """A PATH holding the venv's commands and ``id`` only: no redis-server, apt-get or sudo."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "id").symlink_to(shutil.which("id"))
    return f"{bin_dir}{os.pathsep}{Path(sys.executable).parent}"


@pytest.mark.parametrize("value, expected", [("true", True), ("TRUE", True), ("1", True), ("yes", True),
                                             ("", False), ("false", False), ("0", False)])
def test_ci_flag(value: str, expected: bool) -> None:
    assert ci.in_ci({"CI": value}) is expected
    assert ci.in_ci({}) is False


@pytest.mark.parametrize("ci_value", ["true", ""])
def test_services_script_fails_under_ci_when_redis_cannot_be_installed(path_without_redis: str,
                                                                       ci_value: str) -> None:
    env = {**os.environ, "PATH": path_without_redis, "CI": ci_value}
    done = subprocess.run(["/bin/bash", str(REPO / "scripts" / "test_services.sh")], env=env,
                          capture_output=True, text=True, timeout=60, check=False)
    if ci_value:
        assert done.returncode == 1
        assert "CI=true requires it for the Redis remote-backend tests" in done.stderr
    else:
        assert done.returncode == 0, done.stderr
        assert "redis-server" in done.stderr and "qemu-aarch64" in done.stderr, done.stderr
        assert "the tests that need them will be skipped" in done.stderr


@pytest.mark.parametrize("ci_value", ["true", ""])
def test_redis_tests_fail_under_ci_without_redis_server(path_without_redis: str, ci_value: str) -> None:
    test = "tests/connector/test_redis_remote.py::test_chunks_of_another_layout_are_never_found"
    env = {**os.environ, "PATH": path_without_redis, "CI": ci_value}
    done = run_module("pytest", ["-q", "-p", "no:cacheprovider", "-rsf", test], env, REPO, timeout=300)
    assert "redis-server is not on PATH" in done.stdout, done.stdout[-3000:]
    if ci_value:
        assert done.returncode == 1 and "1 error" in done.stdout, done.stdout[-3000:]
        assert "[CI=true: a component the suite verifies is missing; skipping is not allowed]" in done.stdout
    else:
        assert done.returncode == 0 and "1 skipped" in done.stdout, done.stdout[-3000:]


def test_a_version_the_registry_does_not_have_fails_the_test(tmp_path: Path) -> None:
    """pip reaches the registry and says "No matching distribution found": a wrong pin, not offline."""
    probe = _pip_download("vllm-ascend", "0.0.0.999", tmp_path / "probe", "-q")
    output = probe.stdout + probe.stderr
    if "(from versions: none)" in output:
        ci.missing(f"the package registry listed no vllm-ascend version, so a wrong pin cannot be told apart: "
                   f"{output.strip()[-300:]}")
    assert probe.returncode != 0 and "No matching distribution found" in output, output
    assert not registry_unreachable(output), output
    with pytest.raises(pytest.fail.Exception, match=r"pip download vllm-ascend==0\.0\.0\.999 failed") as failed:
        _download("vllm-ascend", "0.0.0.999", tmp_path)
    assert "No matching distribution found" in str(failed.value)


@pytest.mark.parametrize("ci_value", ["true", ""])
def test_a_registry_pip_cannot_connect_to_skips_outside_ci_only(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               ci_value: str) -> None:
    with socket.socket() as sock:  # a port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{port}/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("CI", ci_value)
    expected = pytest.fail.Exception if ci_value else pytest.skip.Exception
    with pytest.raises(expected, match=r"package registry unreachable, cannot fetch vllm-ascend==0\.23\.0\.post1"):
        _download("vllm-ascend", "0.23.0.post1", tmp_path / "out")


ENV_SEEN = ("CI", "PYTHONHASHSEED", "LMCACHE_TRACK_USAGE")


def recording_stub(path: Path, log: Path) -> None:
    """An executable that appends its name, arguments and the environment variables of ENV_SEEN to ``log``."""
    seen = " ".join(f"{name}=${{{name}:-}}" for name in ENV_SEEN)
    path.write_text(f'#!/bin/sh\necho "$(basename "$0") $* {seen}" >> {log}\n')
    path.chmod(0o755)


def caller_env(bin_dir: Path) -> dict[str, str]:
    """A caller's environment without the variables under test, ``bin_dir`` first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in ENV_SEEN}
    return {**env, "PATH": f"{bin_dir}{os.pathsep}{env['PATH']}"}


def test_ci_run_is_make_test_with_ci_set(tmp_path: Path) -> None:
    """``.ci/run`` runs ``make test`` from the repository root with CI=true whether or not the caller set it;
    the stub called directly (the negative control) sees none of it, so the values come from ``.ci/run``."""
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    recording_stub(bin_dir / "make", log)
    env = caller_env(bin_dir)
    subprocess.run([str(bin_dir / "make"), "direct"], env=env, check=True, timeout=30)
    subprocess.run([str(REPO / ".ci" / "run")], cwd=tmp_path, env=env, check=True, timeout=30)
    assert log.read_text().splitlines() == [
        "make direct CI= PYTHONHASHSEED= LMCACHE_TRACK_USAGE=",
        "make test CI=true PYTHONHASHSEED= LMCACHE_TRACK_USAGE=",
    ]


@pytest.mark.parametrize("ci_value", ["true", ""])
def test_make_test_gives_pytest_the_same_environment_locally_and_in_ci(tmp_path: Path, ci_value: str) -> None:
    """The real Makefile over a stub venv (its set-up stamp fresh, so nothing is installed): ruff and the import
    contracts run in that order, then mypy alongside pytest (either may log first), pytest on two xdist workers
    with the fixed hash seed and no usage tracking, and CI passes through untouched, whatever the caller's
    environment held."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "lint-imports", "redis-server"):
        recording_stub(venv / "bin" / name, log)
    (venv / ".setup-cpu").touch()
    env = {**caller_env(venv / "bin"), "CI": ci_value}
    done = subprocess.run(["make", "--no-print-directory", "test", f"VENV={venv}", "PLATFORM=cpu"], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    plain = f"CI={ci_value} PYTHONHASHSEED= LMCACHE_TRACK_USAGE="
    calls = log.read_text().splitlines()
    assert calls[:2] == [
        f"python -m ruff check lmcache_platforms lmcache_platforms_npu_device.py tests scripts {plain}",
        f"lint-imports --no-cache {plain}",
    ]
    assert sorted(calls[2:]) == [
        f"python -m mypy {plain}",
        "python -m pytest -q -n 2 --no-loadscope-reorder --durations=15 "
        f"CI={ci_value} PYTHONHASHSEED=0 LMCACHE_TRACK_USAGE=false",
    ]


@pytest.mark.parametrize("failing", ["mypy", "pytest"])
def test_make_test_fails_when_mypy_or_pytest_fails(tmp_path: Path, failing: str) -> None:
    """mypy runs alongside pytest: either one failing fails ``make test``, after both ran, and mypy's report is
    printed whichever failed."""
    venv, log = tmp_path / "venv", tmp_path / "calls"
    (venv / "bin").mkdir(parents=True)
    for name in ("lint-imports", "redis-server"):
        recording_stub(venv / "bin" / name, log)
    (venv / "bin" / "python").write_text(
        f'#!/bin/sh\necho "$2" >> {log}\n[ "$2" = mypy ] && echo "mypy: planted report"\n'
        f'[ "$2" != {failing} ]\n')
    (venv / "bin" / "python").chmod(0o755)
    (venv / ".setup-cpu").touch()
    done = subprocess.run(["make", "--no-print-directory", "test", f"VENV={venv}", "PLATFORM=cpu"], cwd=REPO,
                          env=caller_env(venv / "bin"), capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode != 0
    assert "mypy: planted report" in done.stdout
    assert sorted(line.split()[0] for line in log.read_text().splitlines()) == [
        "lint-imports", "mypy", "pytest", "ruff"]
