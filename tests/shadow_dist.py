"""Another version of an installed distribution, as package metadata only.

A folder put first on PYTHONPATH holding ``NAME-VERSION.dist-info`` makes ``importlib.metadata`` (which is how
lmcache_platforms learns upstream versions, without importing them) report that version, while the code
imported is still the installed one: a real way to meet an upstream version the patch catalog was not
written for, without installing it.
"""

from __future__ import annotations

import os
from pathlib import Path


def shadow_distribution(folder: Path, name: str, version: str) -> Path:
    """Write ``NAME-VERSION.dist-info`` into ``folder`` and return ``folder``."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    return folder


def env_with(folder: Path, **extra: str) -> dict[str, str]:
    """This process's environment with ``folder`` first on PYTHONPATH, activation not disabled, ``extra`` set."""
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONPATH": path, **extra}
    env.pop("LMCACHE_PLATFORMS_DISABLE", None)
    return env
