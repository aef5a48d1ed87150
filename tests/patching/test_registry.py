"""The patch registry on throw-away modules: immediate and deferred patching, stale copies, rollback, versions."""

from __future__ import annotations

import importlib
import pathlib
import sys
import textwrap
import threading
import uuid

import pytest

from lmcache_platforms.patching.patch import Patch
from lmcache_platforms.patching.registry import PatchRegistry, PatchState
from lmcache_platforms.patching.versions import UnsupportedUpstreamVersion, check_version


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Writes a fresh package with an upstream module, a stale-copy module and replacements; returns names."""
    pkg = f"fakeup_{uuid.uuid4().hex[:8]}"
    root = tmp_path / pkg
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "target.py").write_text("def thing():\n    return 'upstream'\n\ndef other():\n    return 'upstream'\n")
    (root / "user.py").write_text(f"from {pkg}.target import thing\n")
    (root / "ours.py").write_text(textwrap.dedent("""
        def thing():
            return 'ours'

        def other():
            return 'ours'
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield pkg
    for name in [m for m in sys.modules if m.startswith(pkg)]:
        del sys.modules[name]


def _patch(pkg: str, attr: str = "thing", **kw) -> Patch:
    return Patch(target=f"{pkg}.target:{attr}", replacement=f"{pkg}.ours:{attr}", versions="lmcache>=0",
                 stale_copies=(f"{pkg}.user",), **kw)


def test_imported_target_and_stale_copy_are_replaced_at_once(modules):
    target = importlib.import_module(f"{modules}.target")
    user = importlib.import_module(f"{modules}.user")
    registry = PatchRegistry([_patch(modules)])
    registry.apply()
    ours = importlib.import_module(f"{modules}.ours").thing
    assert target.thing is ours and user.thing is ours
    assert registry.records[0].state is PatchState.APPLIED
    registry.rollback()
    assert target.thing() == "upstream" and user.thing() == "upstream"


def test_target_imported_later_is_patched_by_the_import_hook(modules):
    registry = PatchRegistry([_patch(modules)])
    registry.apply()
    assert f"{modules}.target" not in sys.modules
    assert registry.records[0].state is PatchState.PENDING
    user = importlib.import_module(f"{modules}.user")  # imports target first, then copies the name
    target = sys.modules[f"{modules}.target"]
    assert target.thing() == "ours"
    assert user.thing() == "ours"
    assert registry.records[0].state is PatchState.APPLIED
    registry.rollback()


def test_applying_twice_changes_nothing(modules):
    importlib.import_module(f"{modules}.target")
    registry = PatchRegistry([_patch(modules)])
    registry.apply()
    first = registry.report()
    registry.apply()
    assert registry.report() == first
    registry.rollback()


def test_a_failing_patch_rolls_back_the_ones_before_it(modules):
    target = importlib.import_module(f"{modules}.target")
    broken = Patch(target=f"{modules}.target:other", replacement=f"{modules}.ours:missing", versions="lmcache>=0")
    registry = PatchRegistry([_patch(modules), broken])
    registry.apply()
    assert target.thing() == "upstream" and target.other() == "upstream"
    states = [r.state for r in registry.records]
    assert states == [PatchState.ROLLED_BACK, PatchState.FAILED]
    assert "AttributeError" in registry.records[1].detail
    assert registry.failed == [registry.records[1]]


def test_patch_of_an_absent_package_is_not_applicable_and_refuses_no_version(modules):
    """Its versions could not be checked (nothing installed to check), so the patch stands aside instead."""
    absent = Patch(target="no_such_package_for_sure.mod:thing", replacement=f"{modules}.ours:thing",
                   versions="no_such_package_for_sure==1.0")
    registry = PatchRegistry([absent], version_of=lambda name: None)
    registry.apply()
    record = registry.records[0]
    assert (record.state, record.detail) == (PatchState.NOT_APPLICABLE, "no_such_package_for_sure not installed")


def test_patch_needing_an_absent_module_is_not_applicable(modules):
    registry = PatchRegistry([_patch(modules, requires=("no_such_module_for_sure",))])
    registry.apply()
    record = registry.records[0]
    assert record.state is PatchState.NOT_APPLICABLE
    assert record.detail == "no_such_module_for_sure not installed"


@pytest.mark.parametrize("value", ["1", "true", "on"])
def test_patch_kept_by_a_set_flag_leaves_upstream_alone(modules, monkeypatch, value):
    monkeypatch.setenv("FAKEUP_KEEP", value)
    registry = PatchRegistry([_patch(modules, kept_by="FAKEUP_KEEP"), _patch(modules, attr="other")])
    registry.apply()
    kept, other = registry.records
    assert (kept.state, kept.detail) == (PatchState.NOT_APPLICABLE, "upstream's kept: FAKEUP_KEEP is set")
    target = importlib.import_module(f"{modules}.target")
    assert (target.thing(), target.other()) == ("upstream", "ours")
    assert other.state is PatchState.APPLIED


@pytest.mark.parametrize("value", ["", "0", "no"])
def test_patch_kept_by_an_unset_flag_is_applied(modules, monkeypatch, value):
    monkeypatch.setenv("FAKEUP_KEEP", value)
    registry = PatchRegistry([_patch(modules, kept_by="FAKEUP_KEEP")])
    registry.apply()
    assert importlib.import_module(f"{modules}.target").thing() == "ours"
    assert registry.records[0].state is PatchState.APPLIED


def test_unknown_upstream_version_is_refused_with_both_versions_named(modules):
    importlib.import_module(f"{modules}.target")
    patch = Patch(target=f"{modules}.target:thing", replacement=f"{modules}.ours:thing", versions="lmcache==0.5.6")
    registry = PatchRegistry([patch], version_of=lambda name: "0.4.0")
    with pytest.raises(UnsupportedUpstreamVersion) as err:
        registry.apply()
    assert str(err.value) == (
        "installed lmcache 0.4.0 is not a version these patches know (known: ==0.5.6) "
        "(set LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1 to try anyway)"
    )
    assert sys.modules[f"{modules}.target"].thing() == "upstream"


def test_unknown_version_can_be_allowed_explicitly(modules):
    target = importlib.import_module(f"{modules}.target")
    patch = Patch(target=f"{modules}.target:thing", replacement=f"{modules}.ours:thing", versions="lmcache==0.5.6")
    registry = PatchRegistry([patch], version_of=lambda name: "0.4.0", allow_unknown_versions=True)
    registry.apply()
    assert target.thing() == "ours"
    registry.rollback()


def test_concurrent_apply_patches_once(modules):
    importlib.import_module(f"{modules}.target")
    registry = PatchRegistry([_patch(modules)])
    threads = [threading.Thread(target=registry.apply) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    record = registry.records[0]
    assert record.state is PatchState.APPLIED
    assert record.original() == "upstream"
    registry.rollback()


@pytest.mark.parametrize(
    ("installed", "expected"),
    [("0.5.6", None), ("0.5.6.post1", None), (None, "lmcache is not installed (patches written for lmcache==0.5.6)")],
)
def test_check_version(installed, expected):
    assert check_version("lmcache==0.5.6", installed) == expected


def test_malformed_refs_are_rejected():
    with pytest.raises(ValueError, match=r"expected 'module\.path:attribute'"):
        Patch(target="lmcache.no_colon", replacement="a:b", versions="lmcache==0.5.6")


def test_class_member_wrapper_patch_and_rollback(modules):
    pkg = modules
    target = importlib.import_module(f"{pkg}.target")
    target.Factory = type("Factory", (), {"make": classmethod(lambda cls, x: f"made {x}")})
    ours = importlib.import_module(f"{pkg}.ours")
    ours.guard = lambda original: classmethod(lambda cls, x: "guarded " + original.__func__(cls, x))
    patch = Patch(target=f"{pkg}.target:Factory.make", replacement=f"{pkg}.ours:guard", versions="lmcache>=0",
                  wrapper=True)
    registry = PatchRegistry([patch])
    registry.apply()
    assert target.Factory.make(1) == "guarded made 1"
    registry.rollback()
    assert target.Factory.make(1) == "made 1"


def test_class_member_cannot_declare_stale_copies():
    with pytest.raises(ValueError, match="a class member has no from-import copies"):
        Patch(target="a:B.c", replacement="d:e", versions="lmcache==0.5.6", stale_copies=("x",))


def test_replacement_module_that_imports_its_target_is_waited_for(modules):
    """ours2 imports the target at its top: the target's hook fires while ours2 has no class yet."""
    pkg = modules
    folder = pathlib.Path(importlib.import_module(pkg).__file__).parent
    (folder / "ours2.py").write_text(f"from {pkg}.target import thing as _upstream\n\ndef thing():\n"
                                     "    return 'ours2 over ' + _upstream()\n")
    patch = Patch(target=f"{pkg}.target:thing", replacement=f"{pkg}.ours2:thing", versions="lmcache>=0",
                  stale_copies=(f"{pkg}.user",))
    registry = PatchRegistry([patch])
    registry.apply()
    ours2 = importlib.import_module(f"{pkg}.ours2")
    assert registry.records[0].state is PatchState.PENDING
    assert registry.records[0].detail == f"waiting for {pkg}.ours2 to finish importing"
    registry.retry()
    target = sys.modules[f"{pkg}.target"]
    assert registry.records[0].state is PatchState.APPLIED, registry.records[0].detail
    assert target.thing is ours2.thing and target.thing() == "ours2 over upstream"
    assert importlib.import_module(f"{pkg}.user").thing is ours2.thing
    registry.rollback()


def test_import_targets_applies_pending_patches_or_fails_them_all(modules):
    registry = PatchRegistry([_patch(modules)])
    registry.apply()
    registry.import_targets()
    assert registry.records[0].state is PatchState.APPLIED
    registry.rollback()
    missing = Patch(target=f"{modules}.absent:thing", replacement=f"{modules}.ours:thing", versions="lmcache>=0")
    registry = PatchRegistry([_patch(modules), missing])
    registry.apply()
    registry.import_targets()
    assert [r.state for r in registry.records] == [PatchState.ROLLED_BACK, PatchState.FAILED]
    assert registry.records[1].detail.startswith(f"cannot import {modules}.absent: ModuleNotFoundError")
    assert sys.modules[f"{modules}.target"].thing() == "upstream"


def test_a_target_imported_by_a_module_its_replacement_needs_waits_for_that_import(modules):
    """A module of ours imports the target (its hook fires mid-way) and the replacement imports that module back:
    Python refuses the replacement's import while that module runs. The patch waits (pending), is applied by
    the next retry once the import is done, and nothing is rolled back."""
    pkg = modules
    root = pathlib.Path(importlib.import_module(pkg).__file__).parent
    (root / "side.py").write_text(f"from {pkg} import target\n\ndef helper():\n    return 'ours via side'\n")
    (root / "ours_circ.py").write_text(f"from {pkg}.side import helper\n\ndef thing():\n    return helper()\n")
    registry = PatchRegistry([Patch(target=f"{pkg}.target:thing", replacement=f"{pkg}.ours_circ:thing",
                                    versions="lmcache>=0"), _patch(pkg, "other")])
    registry.apply()
    importlib.import_module(f"{pkg}.side")
    circular, other = registry.records
    assert circular.state is PatchState.PENDING and "partially initialized module" in circular.detail
    assert other.state is PatchState.APPLIED and registry.failed == []
    registry.retry()
    assert circular.state is PatchState.APPLIED
    assert sys.modules[f"{pkg}.target"].thing() == "ours via side"
    registry.rollback()
