"""Pinned upstream source trees for the delivery tests, fetched once with pip and cached between runs.

Sources come from ``pip download --no-deps --no-binary :all:`` (the registry's own sdist), unpacked under
``~/.cache/lmcache_platforms/sdists``. A test is skipped only when the registry cannot be reached; any other
pip failure fails it, with pip's output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest

CACHE = Path(os.environ.get("LMCACHE_PLATFORMS_CACHE", "~/.cache/lmcache_platforms")).expanduser() / "sdists"
_UNREACHABLE = ("NewConnectionError", "Max retries exceeded", "Temporary failure in name resolution",
                "No matching distribution found", "Network is unreachable", "ConnectTimeout")
_BUILD_ENV = {"SOC_VERSION": "ascend910b1"}  # vllm-ascend's setup.py refuses to produce metadata without it


def _download(name: str, version: str, into: Path) -> Path:
    env = {**os.environ, **{k: os.environ.get(k, v) for k, v in _BUILD_ENV.items()}}
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
           "--no-build-isolation", "--disable-pip-version-check", "-q", "-d", str(into), f"{name}=={version}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600, check=False)
    if done.returncode != 0:
        output = done.stdout + done.stderr
        if any(marker in output for marker in _UNREACHABLE):
            pytest.skip(f"package registry unreachable, cannot fetch {name}=={version}: {output.strip()[-300:]}")
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
