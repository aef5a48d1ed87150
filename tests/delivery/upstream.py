"""Pinned upstream source trees for the delivery tests, fetched once with pip and cached between runs.

Sources come from ``pip download --no-deps --no-binary :all:`` (the registry's own sdist), unpacked under
``~/.cache/lmcache_platforms/sdists``. A test is skipped only when pip could not connect to the registry at
all (and fails then too under CI, see tests/ci.py); any other pip failure fails it with pip's output. pip
says "No matching distribution found" both offline and for a version the registry does not have, so that
phrase alone means a wrong pin, never "offline": only connection errors in pip's output do.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

from tests.ci import missing

CACHE = Path(os.environ.get("LMCACHE_PLATFORMS_CACHE", "~/.cache/lmcache_platforms")).expanduser() / "sdists"
# pip's messages when it never got an answer from the index (urllib3 retry warnings and the final errors).
_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                "Name or service not known", "Network is unreachable", "ConnectTimeoutError", "ConnectTimeout",
                "Connection refused", "connection error")
_BUILD_ENV = {"SOC_VERSION": "ascend910b1"}  # vllm-ascend's setup.py refuses to produce metadata without it


def registry_unreachable(pip_output: str) -> bool:
    """Whether a failed ``pip download`` never reached the package index (as opposed to a wrong pin): pip
    could not connect, and no index listed any version (one extra index down does not make a pin right)."""
    listed = re.search(r"\(from versions: (?!none\))", pip_output) is not None
    return not listed and any(marker in pip_output for marker in _UNREACHABLE)


def _pip_download(name: str, version: str, into: Path, verbosity: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in _BUILD_ENV.items()}}
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
           "--disable-pip-version-check", verbosity, "-d", str(into), f"{name}=={version}"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)


def _download(name: str, version: str, into: Path) -> Path:
    done = _pip_download(name, version, into, "-q")
    if done.returncode != 0:
        output = done.stdout + done.stderr
        if "(from versions: none)" in output and not registry_unreachable(output):
            # Without retries pip says nothing about a failed index fetch but in its debug log: ask again.
            debug = _pip_download(name, version, into, "-vv")
            output += "".join(line for line in (debug.stdout + debug.stderr).splitlines(keepends=True)
                              if line.startswith("Could not fetch URL"))
        if registry_unreachable(output):
            missing(f"package registry unreachable, cannot fetch {name}=={version}: {output.strip()[-300:]}")
        pytest.fail(f"pip download {name}=={version} failed:\n{output}")
    archives = sorted(into.glob("*.tar.gz"))
    if len(archives) != 1:
        pytest.fail(f"pip download {name}=={version} left {[a.name for a in into.iterdir()]}, expected one sdist")
    return archives[0]


def source_tree(name: str, version: str) -> Path:
    """The unpacked sdist root of ``name==version`` (downloaded on first use)."""
    target = CACHE / f"{name}-{version}"
    if (target / ".complete").exists():
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as work:
        archive = _download(name, version, Path(work))
        unpacked = Path(work) / "tree"
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        (root,) = unpacked.iterdir()
        (root / ".complete").touch()
        if not (target / ".complete").exists():
            shutil.rmtree(target, ignore_errors=True)
            root.rename(target)
    return target
