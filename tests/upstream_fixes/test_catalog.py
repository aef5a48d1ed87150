"""Every declared patch really replaces what upstream callers use, stale copies included: in this process
where the venv has the patch's modules, else in a subprocess with the module's pinned source tree on the path."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

from lmcache_platforms.patching.registry import PatchState
from lmcache_platforms.upstream_fixes.catalog import PATCHES
from tests.delivery.pins import pins
from tests.delivery.upstream import source_tree
from tests.fork_server import run_module
from tests.upstream_fixes.catalog_check import check_patch

REPO = Path(__file__).resolve().parents[2]
# Modules patches need that the CPU venv lacks by design: the distribution and docker/versions.env pin whose
# source tree provides them.
SOURCES = {"vllm_ascend": ("vllm-ascend", "VLLM_ASCEND_VERSION")}


def _absent(patch) -> list[str]:
    return [m for m in patch.requires if importlib.util.find_spec(m) is None]


def _check_in_subprocess(patch, absent: list[str]) -> dict:
    unknown = [m for m in absent if m not in SOURCES]
    assert not unknown, f"{patch.target} needs {unknown}: neither installed nor a pinned source tree in SOURCES"
    trees = [str(source_tree(SOURCES[m][0], pins()[SOURCES[m][1]])) for m in absent]
    # Only our vLLM plugin: vllm-ascend's platform plugin (found through the tree's egg-info) needs torch_npu.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*trees, str(REPO)]), "VLLM_PLUGINS": "lmcache_platforms"}
    proc = run_module("tests.upstream_fixes.catalog_check", [patch.target], env, REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target for p in PATCHES])
def test_patch_replaces_the_object_upstream_callers_use(patch):
    absent = _absent(patch)
    if absent:
        result = _check_in_subprocess(patch, absent)
        assert result["state"] == "applied"
        if "vllm_ascend" in absent:
            assert result["names"] == ["LMCachePlatformsConnector", "LMCacheAscendConnector"]
        return
    check_patch(patch)


def test_catalog_targets_are_unique_and_pinned():
    targets = [p.target for p in PATCHES]
    assert len(targets) == len(set(targets))
    for patch in PATCHES:
        assert "==" in patch.versions or "<" in patch.versions, f"{patch.target} has an open version range"


def test_every_applicable_patch_ends_applied_after_import():
    from lmcache_platforms.activation import activate

    registry = activate().registry
    assert registry is not None
    for record in registry.records:
        if record.state is PatchState.NOT_APPLICABLE:
            continue
        importlib.import_module(record.patch.module)
        assert record.state is PatchState.APPLIED, f"{record.patch.target}: {record.detail}"
