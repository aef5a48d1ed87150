"""docs/configuration.md is scripts/config_docs.py's output from the settings' declarations, and every variable the
package reads from the environment is documented there."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import pytest

from lmcache_platforms.config import SETTINGS

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "config_docs.py"


@pytest.fixture(scope="module")
def script() -> dict:
    return runpy.run_path(str(SCRIPT))


def test_the_committed_page_is_the_scripts_output(script) -> None:
    assert (REPO / "docs" / "configuration.md").read_text() == script["render"](), "run scripts/config_docs.py"


def test_every_variable_the_package_reads_is_documented(script) -> None:
    sources = [*(REPO / "lmcache_platforms").rglob("*.py"), REPO / "lmcache_platforms_npu_device.py"]
    read = {name for path in sources for name in re.findall(r"\bLMCACHE_PLATFORMS_[A-Z_]*[A-Z]\b", path.read_text())}
    documented = {s.env for s in SETTINGS} | {name.split("=")[0] for name, _ in script["ENVIRONMENT_ONLY"]}
    assert read <= documented, sorted(read - documented)
    assert "LMCACHE_PLATFORMS_DISABLE" in read


def test_a_pipe_inside_a_cell_is_escaped(script) -> None:
    assert script["cell"]("a `x|y` b") == r"a `x\|y` b"
