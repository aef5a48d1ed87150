"""docs/architecture.md's layer table is true: its rows are the packages of the import-linter ``layers`` contract
in ``pyproject.toml``, in the contract's order, and each row's last column is what that package really imports
of ours (``lint-imports`` enforces the contract itself). Also the one dependency import-linter cannot see: the
patch catalog names its replacements in strings, and those must live in the layers below it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import grimp

from lmcache_platforms.patching.patch import split_ref
from lmcache_platforms.upstream_fixes.catalog import PATCHES

REPO = Path(__file__).resolve().parents[1]
ROOT = "lmcache_platforms"


def _layers() -> list[set[str]]:
    """The layers contract, top first; each layer the set of its packages."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["id"] == "layers"]
    assert contract["containers"] == [ROOT] and contract["exhaustive"] is True
    return [{name.strip() for name in re.split(r"[|:]", layer)} for layer in contract["layers"]]


def _package(cell: str) -> str:
    """A table row's package as the contract names it: ``integration/vllm/`` -> integration; the root module's
    row (``__init__.py``, ``activation.py``) -> activation."""
    names = {re.split(r"[/.]", name)[0] for name in re.findall(r"`([^`]+)`", cell)} - {"__init__"}
    assert len(names) == 1, cell
    return names.pop()


def _table() -> list[tuple[str, set[str]]]:
    """(package, imports of ours) per row of the Layers table, top first."""
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    table = []
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split(" | ")]
        imports = set() if cells[-1] == "none" else {name.strip() for name in cells[-1].split(",")}
        table.append((_package(cells[0]), imports))
    return table


def _real_imports() -> dict[str, set[str]]:
    """Per package of ours, the packages of ours its modules import directly (the root module counts as
    activation, which it imports and whose row it shares)."""
    graph = grimp.build_graph(ROOT, cache_dir=None)

    def package(module: str) -> str:
        parts = module.split(".")
        return "activation" if len(parts) == 1 else parts[1]

    imports: dict[str, set[str]] = {}
    for module in graph.modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if package(imported) != package(module):
                imports.setdefault(package(module), set()).add(package(imported))
    return imports


def test_the_table_lists_the_contract_layers_in_order() -> None:
    layers = _layers()
    packages = [package for package, _ in _table()]
    assert sorted(packages) == sorted(set().union(*layers)), "rows and contract list different packages"
    position = [next(i for i, layer in enumerate(layers) if package in layer) for package in packages]
    assert position == sorted(position), f"rows out of the contract's order: {packages}"


def test_the_table_names_what_each_package_imports() -> None:
    real = _real_imports()
    for package, documented in _table():
        code = real.get(package, set())
        assert documented == code, f"{package}: the table says {sorted(documented)}, the code imports {sorted(code)}"


def test_the_catalog_names_replacements_only_in_the_layers_below_it() -> None:
    layers = _layers()
    catalog_layer = next(i for i, layer in enumerate(layers) if "upstream_fixes" in layer)
    below = set().union(*layers[catalog_layer:])
    for patch in PATCHES:
        module = split_ref(patch.replacement)[0]
        assert module.split(".")[0] == ROOT and module.split(".")[1] in below, patch.replacement
