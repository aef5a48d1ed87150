"""The README stays a front door (at most 200 lines) and the docs hold together: every relative link and anchor
resolves, every test file a page names exists, and every metric family a page names is one the connector
exports."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from lmcache_platforms.integration.vllm.stats import COUNTERS, LABELLED, PREFIX, TIMINGS

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", REPO / "DEVELOPERS.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
ANCHOR = runpy.run_path(str(REPO / "scripts" / "bench_docs.py"))["anchor"]


def anchors(page: Path) -> set[str]:
    """The fragments GitHub gives the page's headings (outside code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {ANCHOR(title) for title in re.findall(r"^#+ (.+)$", text, re.M)}


def test_the_readme_has_at_most_200_lines() -> None:
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if "://" in target:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (fragment and fragment not in anchors(linked)):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_test_file_named_exists(page: Path) -> None:
    named = set(re.findall(r"`(tests/[\w/]+\.py)`", page.read_text()))
    assert sorted(n for n in named if not (REPO / n).is_file()) == []


def test_every_metric_family_named_is_exported() -> None:
    families = ({f"{PREFIX}{name}_total" for name in (*COUNTERS, *LABELLED)}
                | {f"{PREFIX}{name}{suffix}" for name in TIMINGS for suffix in ("", "_sum", "_count", "_bucket")})
    named = {name for page in PAGES for name in re.findall(r"vllm:lmcache_platforms_\w+", page.read_text())}
    assert named and sorted(named - families) == []
