"""The declaration of one upstream replacement: what, by what, for which upstream versions."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any


def split_ref(ref: str) -> tuple[str, str]:
    """``"pkg.module:attr"`` (or ``"pkg.module:Class.attr"``) -> ``("pkg.module", "attr")``."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr or "" in attr.split("."):
        raise ValueError(f"expected 'module.path:attribute', got {ref!r}")
    return module, attr


def resolve_owner(module: Any, attr: str) -> tuple[Any, str]:
    """The object holding the last name of a dotted ``attr`` inside ``module``, and that name."""
    *path, name = attr.split(".")
    owner = module
    for part in path:
        owner = getattr(owner, part)
    return owner, name


def resolve(ref: str) -> Any:
    """Import ``module`` and return its (possibly dotted) ``attr``."""
    module, attr = split_ref(ref)
    owner, name = resolve_owner(importlib.import_module(module), attr)
    return getattr(owner, name)


@dataclass(frozen=True)
class Patch:
    """One upstream symbol we replace.

    ``versions`` is a requirement string on the distribution that owns the target (``"lmcache==0.5.6"``); the
    patch is refused when the installed version is outside it. ``stale_copies`` name modules that did
    ``from target_module import attr`` and so hold the original object under the same name: they are rebound
    too. A dotted attribute (``Class.method``) replaces a class member. With ``wrapper``, ``replacement`` is
    called with the original (the raw class attribute, e.g. a classmethod object) and returns what to install.
    ``requires`` names top-level modules that must be installed for the patch to apply at all, besides the
    target's own package, which always must (otherwise it is "not applicable", e.g. vLLM integration on a machine
    without vLLM). ``kept_by`` names an environment flag
    that, set to 1/true/yes/on, leaves the upstream symbol as it is (also "not applicable").
    """

    target: str
    replacement: str
    versions: str
    stale_copies: tuple[str, ...] = ()
    requires: tuple[str, ...] = ()
    why: str = ""
    wrapper: bool = False
    kept_by: str = ""

    def __post_init__(self) -> None:
        split_ref(self.target)
        split_ref(self.replacement)
        if "." in self.attr and self.stale_copies:
            raise ValueError(f"{self.target}: a class member has no from-import copies to rebind")

    @property
    def module(self) -> str:
        return split_ref(self.target)[0]

    @property
    def attr(self) -> str:
        return split_ref(self.target)[1]
