"""Install the faulty kernel backend as a real distribution, so other processes find it by its entry point.

``install_faulty_backend(dir)`` writes ``lmcache_platforms_faulty_backend.py`` (a copy of
``faulty_backend.py``) and ``lmcache_platforms_faulty-0.0.0.dist-info`` (METADATA, entry_points.txt,
RECORD) into ``dir``. With ``dir`` on ``PYTHONPATH``, ``importlib.metadata.entry_points`` in any process of
this virtualenv lists ``faulty`` in the ``lmcache_platforms.kernel_backends`` group, exactly as it would a
pip-installed third-party backend; nothing from ``tests`` needs to be importable there.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from lmcache_platforms.kernels.registry import ENTRY_POINT_GROUP

BACKEND_NAME = "faulty"
MODULE = "lmcache_platforms_faulty_backend"
DIST = "lmcache_platforms_faulty-0.0.0.dist-info"


def install_faulty_backend(directory: Path) -> Path:
    """Write the module and its dist-info into ``directory``; return the path to put on ``PYTHONPATH``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("faulty_backend.py"), directory / f"{MODULE}.py")
    dist = directory / DIST
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: lmcache-platforms-faulty\nVersion: 0.0.0\n"
        "Summary: TEST FAULT: a kernel backend that damages KV rows on purpose\n"
    )
    (dist / "entry_points.txt").write_text(f"[{ENTRY_POINT_GROUP}]\n{BACKEND_NAME} = {MODULE}:FaultyBackend\n")
    (dist / "RECORD").write_text(f"{MODULE}.py,,\n{DIST}/METADATA,,\n{DIST}/entry_points.txt,,\n{DIST}/RECORD,,\n")
    return directory


def faulty_env(path: Path, fault: str, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """``base`` (default ``os.environ``) plus what makes a child process run ``fault`` through the backend.

    ``path`` (from ``install_faulty_backend``) goes first on ``PYTHONPATH``, the backend is chosen by
    ``LMCACHE_PLATFORMS_KERNEL_BACKEND`` (the ``platforms.kernel_backend`` setting) and the damage by
    ``LMCACHE_PLATFORMS_FAULT``.
    """
    env = dict(os.environ if base is None else base)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH", "")) if p)
    env["LMCACHE_PLATFORMS_KERNEL_BACKEND"] = BACKEND_NAME
    env["LMCACHE_PLATFORMS_FAULT"] = fault
    return env
