"""layout/ is the pure core: it may import the standard library (but not logging: it reports through its
errors), torch and itself, nothing else."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import lmcache_platforms.layout

LAYOUT = Path(lmcache_platforms.layout.__file__).parent


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_layout_imports_only_stdlib_torch_and_itself():
    offending = {}
    for path in sorted(LAYOUT.glob("*.py")):
        bad = {name for name in _imports(path)
               if (name.split(".")[0] not in sys.stdlib_module_names or name.split(".")[0] == "logging")
               and name.split(".")[0] != "torch" and not name.startswith("lmcache_platforms.layout")}
        if bad:
            offending[path.name] = sorted(bad)
    assert offending == {}
    assert len(list(LAYOUT.glob("*.py"))) >= 8
