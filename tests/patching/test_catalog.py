"""Every declared patch really replaces what upstream callers use, stale copies included."""

from __future__ import annotations

import importlib

import pytest

import lmcache_platforms
from lmcache_platforms.patching.catalog import PATCHES
from lmcache_platforms.patching.patch import resolve, resolve_owner
from lmcache_platforms.patching.registry import PatchState


def _installed(patch) -> bool:
    return all(importlib.util.find_spec(m) is not None for m in patch.requires)


@pytest.mark.parametrize("patch", PATCHES, ids=[p.target for p in PATCHES])
def test_patch_replaces_the_object_upstream_callers_use(patch):
    if not _installed(patch):
        pytest.skip(f"{patch.requires} not installed here")
    assert lmcache_platforms.status()["activated"]
    owner, name = resolve_owner(importlib.import_module(patch.module), patch.attr)
    installed = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    ours = resolve(patch.replacement)
    if patch.wrapper:
        record = next(r for r in lmcache_platforms.activate().registry.records if r.patch is patch)
        assert installed is record.replacement and record.original is not installed
        return
    assert installed is ours
    for name in patch.stale_copies:
        module = importlib.import_module(name)
        assert getattr(module, patch.attr) is ours, f"{name}.{patch.attr} still holds upstream's object"


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
