"""Answers that depend only on their inputs (vLLM without a connector: a model's weights, the prompts, the engine
settings), computed once per test session and shared by the pytest-xdist workers.

Such a baseline is deterministic, so a second engine computing it again proves nothing and costs a whole engine
start; the tests that need one may land on either worker. The value is kept as JSON in a folder both workers
see (the session's pytest base folder), under a digest of everything it depends on, and computed under a file
lock by whichever worker asks first; the other waits for it and reads it. A key names the model by the digest
of its files, so two workers' copies of a model written from the same seed share the entry, and copies that
differ do not. ``tests/integration/test_recurrent_e2e.py`` checks a cached answer against one computed afresh.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


def session_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """This run's folder for shared answers: the session's base folder, whose ``popen-gwN`` children are the
    xdist workers' own (without xdist: the base folder itself)."""
    base = tmp_path_factory.getbasetemp()
    folder = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "session-cache"
    folder.mkdir(exist_ok=True)
    return folder


def folder_digest(folder: Path) -> str:
    """The digest of every file's name and bytes in ``folder`` (a model: config, tokenizer, weights)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def cached(folder: Path, key: dict[str, Any], compute: Callable[[], Any]) -> Any:
    """``compute()``'s JSON value for ``key``: from the session's folder, or computed (by one worker at a time)
    and kept there."""
    name = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    path = folder / f"{name}.json"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())["value"]
        value = compute()
        part = path.with_suffix(".part")
        part.write_text(json.dumps({"key": key, "value": value}))
        part.rename(path)
        return value
