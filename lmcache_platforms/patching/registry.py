"""Applies a set of declared patches once, atomically, now or when their target module is first imported.

Targets already imported are patched at once; the others through post-import hooks (wrapt), so importing us
never imports upstream early. Any failure rolls back every patch this registry applied: nothing is left
half-applied. Stale ``from X import Y`` copies are rebound with the target, also when imported later.
"""

from __future__ import annotations

import enum
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import wrapt

from lmcache_platforms.log import init_logger
from lmcache_platforms.patching.patch import Patch, resolve, resolve_owner, split_ref
from lmcache_platforms.patching.versions import (
    UnsupportedUpstreamVersion,
    check_version,
    installed_version,
    requirement_name,
)

logger = init_logger(__name__)


class PatchState(enum.Enum):
    PENDING = "pending"  # target module not imported yet; applied by a post-import hook
    APPLIED = "applied"
    NOT_APPLICABLE = "not applicable"
    FAILED = "failed"
    ROLLED_BACK = "rolled back"


@dataclass
class PatchRecord:
    """What happened to one patch, and the originals needed to undo it."""

    patch: Patch
    state: PatchState = PatchState.PENDING
    detail: str = ""
    original: Any = None
    replacement: Any = None
    rebound: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {"target": self.patch.target, "applied": self.state is PatchState.APPLIED,
                "state": self.state.value, "detail": self.detail}


def _finished(name: str, just_imported: str | None) -> bool:
    """True when module ``name`` is imported and done running its code (the one whose import hook is firing
    counts as done; CPython marks a module still executing through ``__spec__._initializing``)."""
    if name == just_imported:
        return True
    module = sys.modules.get(name)
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


def _circular(exc: ImportError) -> bool:
    """Whether ``exc`` is Python's refusal to take a name from a module still running its own code."""
    return "partially initialized module" in str(exc)


def _kept(patch: Patch) -> bool:
    """The user asked to keep this upstream symbol (``Patch.kept_by``)."""
    return bool(patch.kept_by) and os.environ.get(patch.kept_by, "").strip().lower() in {"1", "true", "yes", "on"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class PatchRegistry:
    """Owns the records of one set of patches; ``apply`` once, ``rollback`` to undo everything."""

    def __init__(
        self,
        patches: Sequence[Patch],
        *,
        allow_unknown_versions: bool = False,
        version_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self.records = [PatchRecord(p) for p in patches]
        self._allow_unknown = allow_unknown_versions
        self._version_of = version_of or installed_version
        self._lock = threading.RLock()
        self._active = False
        self._hooked: set[str] = set()

    def apply(self) -> None:
        """Check versions, then patch what is imported and hook the rest. Raises UnsupportedUpstreamVersion
        (nothing applied) when an applicable patch targets an unknown upstream version. A patch whose target's
        top-level package is not installed is not applicable: a machine without LMCache (``make device-check``
        on a GPU image) runs the layout and kernels with nothing to patch and nothing to refuse."""
        with self._lock:
            if self._active:
                return
            applicable = []
            for record in self.records:
                needed = dict.fromkeys((record.patch.module.split(".")[0], *record.patch.requires))
                missing = [m for m in needed if not _installed(m)]
                if _kept(record.patch):
                    record.state = PatchState.NOT_APPLICABLE
                    record.detail = f"upstream's kept: {record.patch.kept_by} is set"
                elif missing:
                    record.state = PatchState.NOT_APPLICABLE
                    record.detail = f"{', '.join(missing)} not installed"
                else:
                    applicable.append(record)
            refusals = self._version_refusals(applicable)
            if refusals and not self._allow_unknown:
                raise UnsupportedUpstreamVersion(
                    "; ".join(refusals) + " (set LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1 to try anyway)"
                )
            for reason in refusals:
                logger.warning("%s; patching anyway because LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1", reason)
            self._active = True
            for record in applicable:
                record.detail = f"waiting for import of {record.patch.module}"
            for module in dict.fromkeys(r.patch.module for r in applicable):
                self._hook(module)

    def _version_refusals(self, records: Sequence[PatchRecord]) -> list[str]:
        reasons: dict[str, None] = {}
        for record in records:
            reason = check_version(record.patch.versions, self._version_of(requirement_name(record.patch.versions)))
            if reason:
                reasons[reason] = None
        return list(reasons)

    def _hook(self, module: str) -> None:
        if module not in self._hooked:
            self._hooked.add(module)
            wrapt.register_post_import_hook(self._on_import, module)

    def _on_import(self, module: ModuleType) -> None:
        """Post-import hook: patch what became ready, and rebind stale copies held by ``module``."""
        with self._lock:
            if not self._active:
                return
            self._apply_ready(module.__name__)
            for record in self.records:
                if record.state is PatchState.APPLIED and module.__name__ in record.patch.stale_copies:
                    self._rebind(record, module)

    def import_targets(self) -> None:
        """Import every pending target module now, so each patch is applied or fails here and not first in a
        serving process (``doctor``). A target that cannot be imported fails its patch like any other error."""
        for record in self.records:
            if record.state is not PatchState.PENDING:
                continue
            try:
                importlib.import_module(record.patch.module)
            except Exception as exc:  # noqa: BLE001 - reported on the record, everything rolled back
                with self._lock:
                    record.state = PatchState.FAILED
                    record.detail = f"cannot import {record.patch.module}: {type(exc).__name__}: {exc}"
                    self.rollback(reason=f"rolled back because {record.patch.target} failed")
                return
        self.retry()

    def retry(self) -> None:
        """Apply pending patches whose modules have finished importing since their hook fired."""
        with self._lock:
            if self._active:
                self._apply_ready(None)

    def _apply_ready(self, just_imported: str | None) -> None:
        """Patch, as one batch, every pending target whose module and replacement module are complete.

        A replacement module still running its own code (it imported the target, whose hook fired
        mid-way) is waited for: its class may not exist yet. The next hook or ``retry`` applies it.
        """
        batch = []
        for record in self.records:
            if record.state is not PatchState.PENDING or not _finished(record.patch.module, just_imported):
                continue
            replacement_module = split_ref(record.patch.replacement)[0]
            if replacement_module in sys.modules and not _finished(replacement_module, just_imported):
                record.detail = f"waiting for {replacement_module} to finish importing"
                continue
            batch.append(record)
        if batch:
            self._apply_batch(batch)

    def _apply_batch(self, batch: Sequence[PatchRecord]) -> None:
        for record in batch:
            try:
                self._apply_one(record)
            except ImportError as exc:
                if not _circular(exc):
                    self._fail(record, exc)
                    return
                # The target was imported by a module of ours still running (its replacement imports that
                # module back): wait for it, as for a replacement module still importing.
                record.detail = f"waiting for a circular import to finish ({exc})"
            except Exception as exc:  # noqa: BLE001 - any failure must roll everything back, then be reported
                self._fail(record, exc)
                return

    def _fail(self, record: PatchRecord, exc: Exception) -> None:
        record.state = PatchState.FAILED
        record.detail = f"{type(exc).__name__}: {exc}"
        logger.error("patch of %s failed (%s); rolling back every lmcache_platforms patch", record.patch.target,
                     record.detail)
        self.rollback(reason=f"rolled back because {record.patch.target} failed")

    def _apply_one(self, record: PatchRecord) -> None:
        patch = record.patch
        owner, name = resolve_owner(sys.modules[patch.module], patch.attr)
        record.original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        replacement = resolve(patch.replacement)
        record.replacement = replacement(record.original) if patch.wrapper else replacement
        setattr(owner, name, record.replacement)
        record.state = PatchState.APPLIED
        record.detail = f"{patch.target} -> {patch.replacement}"
        for name in patch.stale_copies:
            if name in sys.modules:
                self._rebind(record, sys.modules[name])
            else:
                self._hook(name)

    def _rebind(self, record: PatchRecord, module: ModuleType) -> None:
        if getattr(module, record.patch.attr, None) is record.original:
            setattr(module, record.patch.attr, record.replacement)
            record.rebound.append(module.__name__)

    def rollback(self, reason: str = "rolled back") -> None:
        """Restore every original this registry replaced; pending patches will not be applied any more."""
        with self._lock:
            self._active = False
            for record in reversed(self.records):
                if record.state is PatchState.APPLIED:
                    owner, name = resolve_owner(sys.modules[record.patch.module], record.patch.attr)
                    setattr(owner, name, record.original)
                    for name in record.rebound:
                        module = sys.modules.get(name)
                        if module is not None and getattr(module, record.patch.attr, None) is record.replacement:
                            setattr(module, record.patch.attr, record.original)
                    record.rebound.clear()
                    record.state = PatchState.ROLLED_BACK
                    record.detail = reason
                elif record.state is PatchState.PENDING:
                    record.state = PatchState.ROLLED_BACK
                    record.detail = reason

    def report(self) -> list[dict[str, Any]]:
        self.retry()
        with self._lock:
            return [r.as_dict() for r in self.records]

    @property
    def failed(self) -> list[PatchRecord]:
        return [r for r in self.records if r.state is PatchState.FAILED]
