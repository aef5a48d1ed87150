"""LMCache's own methods put back for one test in place of the patch catalog's: the negative controls that show a
test fails without our patch."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def put_back(monkeypatch: pytest.MonkeyPatch, chosen: Callable[[Any], bool]) -> list[Any]:
    """Restore the original of every applied catalog patch ``chosen(patch)`` picks, for this test; their records."""
    import lmcache_platforms
    from lmcache_platforms.patching.patch import resolve_owner

    records = [r for r in lmcache_platforms.activate().registry.records if chosen(r.patch)]
    for record in records:
        owner, name = resolve_owner(__import__(record.patch.module, fromlist=["_"]), record.patch.attr)
        monkeypatch.setattr(owner, name, record.original)
    return records
