"""docs/benchmarks.md is scripts/bench_docs.py's output from docs/bench/*.json, so no table is edited by hand, and
every record says when, where and how its figures were measured."""

from __future__ import annotations

import datetime
import json
import runpy
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "bench_docs.py"


@pytest.fixture(scope="module")
def script() -> dict:
    return runpy.run_path(str(SCRIPT))


def test_the_committed_page_is_the_scripts_output(script) -> None:
    assert (REPO / "docs" / "benchmarks.md").read_text() == script["render"](), "run scripts/bench_docs.py"


def test_every_record_names_its_date_machine_and_command(script) -> None:
    records = [r for page in script["load_pages"]() for r in page["records"]]
    assert records
    for record in records:
        date = record["date"]["recorded"] if isinstance(record["date"], dict) else record["date"]
        assert datetime.date.fromisoformat(date).year >= 2026 and len(date) == 10, record["id"]
        assert record["machine"] and record["command"], record["id"]


def test_a_record_without_a_command_is_refused(script, tmp_path: Path) -> None:
    page = {"order": 1, "title": "t", "records": [{"id": "x", "title": "x", "date": "2026-11-28", "machine": "m"}]}
    (tmp_path / "x.json").write_text(json.dumps(page))
    with pytest.raises(ValueError, match=r"^x.json: record 'x' lacks \['command'\] or has unknown fields \[\]; "):
        script["load_pages"](tmp_path)


def test_a_row_must_fill_its_columns(script, tmp_path: Path) -> None:
    page = {"order": 1, "title": "t", "records": [{"id": "x", "title": "x", "date": "2026-11-28", "machine": "m",
                                                     "command": "c", "table": {"columns": ["a", "b"],
                                                                               "rows": [["1"]]}}]}
    (tmp_path / "x.json").write_text(json.dumps(page))
    with pytest.raises(ValueError, match=r"^table row \['1'\] has 1 cells for 2 columns$"):
        script["render"](tmp_path)
