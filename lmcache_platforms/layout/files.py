"""Layout files (JSON): read and written here; shipped examples live in ``lmcache_platforms/examples`` and are
found by name (``gemma3``) as well as by path. Real tensors for a layout file are made by
``lmcache_platforms.tools.fixtures`` (a tool, not part of what runs inside vLLM).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lmcache_platforms.layout.errors import LayoutError
from lmcache_platforms.layout.spec import LayoutSpec

EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "examples"


def example_names() -> list[str]:
    """Names of the shipped example layouts."""
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.json"))


def example_path(name: str) -> Path:
    return EXAMPLES_DIR / f"{name}.json"


def load_layout_spec(path_or_name: str | os.PathLike[str]) -> LayoutSpec:
    """Read a layout file, or a shipped example by name; LayoutError names the file and the bad value."""
    path = Path(path_or_name)
    if path.is_dir():
        raise LayoutError(f"{path_or_name}: a folder, not a layout file (give a layout JSON file, or an example: "
                          f"{', '.join(example_names())})")
    if not path.is_file():
        if str(path_or_name) not in example_names():
            raise LayoutError(f"{path_or_name}: no such layout file or example "
                              f"(examples: {', '.join(example_names())})")
        path = example_path(str(path_or_name))
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as exc:
        raise LayoutError(f"{path}: cannot read: {exc}") from None
    except json.JSONDecodeError as exc:
        raise LayoutError(f"{path}: not valid JSON: {exc}") from None
    return LayoutSpec.from_dict(data, str(path))


def save_layout_spec(spec: LayoutSpec, path: str | os.PathLike[str]) -> None:
    """Write ``spec`` as a layout file that ``load_layout_spec`` reads back equal."""
    Path(path).write_text(json.dumps(spec.to_dict(), indent=2) + "\n")
