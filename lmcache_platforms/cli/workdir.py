"""The working folder of a run that starts servers (``demo``, ``soak``): the user's, or a temporary one that is
removed when the run found no problem, so the logs of a failed run are always there to read."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def run_in_workdir(workdir: Path | None, keep: bool, prefix: str, progress: Callable[[str], None],
                   body: Callable[[Path], list[str]]) -> int:
    """``body(folder)`` returns the problems it found; exit code 1 if any (or if it raised), else 0. A temporary
    folder is removed after a clean or interrupted run unless ``keep``; otherwise its path is printed."""
    temporary = workdir is None
    folder = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    found = ["not finished"]
    try:
        found = body(folder)
    except KeyboardInterrupt:
        found = []  # stopped by the user (Ctrl-C, SIGTERM): nothing to read, the folder goes
        raise
    finally:
        if temporary and not found and not keep:
            shutil.rmtree(folder, ignore_errors=True)
        elif temporary:
            progress(f"logs kept in {folder}")
    return 1 if found else 0
