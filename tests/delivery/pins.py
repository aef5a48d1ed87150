"""The upstream versions the delivery pins: docker/versions.env, and setup.py's LMCache requirement."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@functools.cache
def pins() -> dict[str, str]:
    """KEY=VALUE lines of docker/versions.env."""
    out = {}
    for line in (REPO / "docker" / "versions.env").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key] = value
    return out


def setup_constants() -> dict[str, str]:
    """Module-level string constants of setup.py (read, not executed)."""
    tree = ast.parse((REPO / "setup.py").read_text())
    return {
        target.id: node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
        and isinstance(node.value.value, str)
        for target in node.targets if isinstance(target, ast.Name)
    }
