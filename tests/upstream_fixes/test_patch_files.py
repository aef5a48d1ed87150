"""patches/ holds what ``scripts/make_patches.py`` makes from the catalog's LMCache fixes, every patch applies to the
pinned LMCache, and the patched copy passes the fixes' checks with lmcache_platforms disabled.

The checks run in a subprocess whose path starts with the patched copy: ``patched_checks.py`` (one check per patch,
through upstream's classes alone) and the two tests of ``test_dp_device.py`` that call LMCache's function without
our activation (its third, the negative control, puts back the original our activation replaced).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
CHECKS = ["tests/upstream_fixes/patched_checks.py",
          "tests/upstream_fixes/test_dp_device.py::test_a_rank_with_its_own_device_table_gets_that_tables_device",
          "tests/upstream_fixes/test_dp_device.py::test_without_a_device_table_upstreams_offset_stays"]
CHECK_COUNT = 10  # patched_checks.py's 8 (0003 twice) and test_dp_device.py's 2


def _generator():
    return importlib.import_module("scripts.make_patches")


def test_the_committed_patches_are_the_generators_output() -> None:
    expected = _generator().render()
    assert sorted(p.name for p in PATCHES.iterdir()) == sorted(expected)
    for name, text in expected.items():
        assert (PATCHES / name).read_text() == text, f"patches/{name} is stale: run python -m scripts.make_patches"


def test_every_catalog_fix_is_a_patch_or_left_out_with_its_reason() -> None:
    generator = _generator()
    generator.check_coverage()
    readme = (PATCHES / "README.md").read_text()
    for patch_file in generator.PATCH_FILES:
        assert f"`{patch_file.name}.patch`" in readme
    for _, reason in generator.LEFT_OUT:
        assert f": {reason}.\n" in readme


def test_every_patch_applies_to_the_pinned_lmcache_and_its_checks_pass_with_activation_off(tmp_path: Path) -> None:
    if shutil.which("patch") is None:
        pytest.fail("the `patch` tool (Debian package patch) is needed to apply patches/")
    site = tmp_path / "site-packages"
    shutil.copytree(_generator().lmcache_root() / "lmcache", site / "lmcache", symlinks=True)
    for patch in sorted(PATCHES.glob("*.patch")):
        for dry_run in (["--dry-run"], []):
            done = subprocess.run(["patch", "-p1", "--forward", "--batch", *dry_run, "-d", str(site), "-i", str(patch)],
                                  capture_output=True, text=True, check=False)
            assert done.returncode == 0, f"{patch.name} does not apply:\n{done.stdout}{done.stderr}"
            assert "offset" not in done.stdout and "fuzz" not in done.stdout, done.stdout
    env = {**os.environ, "LMCACHE_PLATFORMS_DISABLE": "1", "LMCACHE_PLATFORMS_PATCHED_COPY": str(site),
           "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *CHECKS], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert re.fullmatch(rf"{CHECK_COUNT} passed in [\d.]+s", summary), summary
