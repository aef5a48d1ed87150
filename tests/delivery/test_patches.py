"""Every source patch in patches/ applies cleanly to the pinned upstream sdist it names."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.delivery.pins import REPO
from tests.delivery.upstream import source_tree

PATCHES = sorted((REPO / "patches").glob("*/*.patch"))
_FOLDER = re.compile(r"^(?P<name>[A-Za-z0-9_.-]+?)-(?P<version>\d[\w.+-]*)$")


def test_patch_folders_name_a_release_and_readme_explains():
    readme = (REPO / "patches" / "README.md").read_text()
    assert "Convention" in readme
    if not PATCHES:
        assert "Why there are none today" in readme and "LMCacheAscendConnector" in readme
    for folder in {p.parent for p in PATCHES}:
        assert _FOLDER.match(folder.name), f"{folder.name} is not <distribution>-<version>"


@pytest.mark.skipif(not PATCHES, reason="patches/ holds no source patch (patches/README.md says why)")
@pytest.mark.parametrize("patch", PATCHES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_patch_applies_to_its_pinned_source(patch, tmp_path):
    if shutil.which("patch") is None:
        pytest.fail("the `patch` tool is needed to check patches/")
    match = _FOLDER.match(patch.parent.name)
    tree = source_tree(match["name"], match["version"])
    done = subprocess.run(["patch", "-p1", "--dry-run", "--forward", "-d", str(tree), "-i", str(patch)],
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"{patch.name} does not apply to {tree.name}:\n{done.stdout}{done.stderr}"
