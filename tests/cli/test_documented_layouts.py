"""The docs' layout claims, read from the docs themselves: docs/layouts.md's layout-file example parses, plans as it
describes and round-trips bit for bit; the shipped example names it lists exist; and the launches per chunk in
the benchmarks' CPU kernel table (docs/bench/kernels.json) are what the plan says and what our connector really
makes through a real LMCacheEngine (deepseek-v4: three, one per saved group)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lmcache_platforms.cli.main import main
from lmcache_platforms.layout import example_names, load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import materialize, plan

REPO = Path(__file__).resolve().parents[2]
LAYOUTS = REPO / "docs" / "layouts.md"
KERNEL_BENCH = REPO / "docs" / "bench" / "kernels.json"


def documented_layout_file() -> str:
    (block,) = re.findall(r"```json\n(.*?)```", LAYOUTS.read_text(), re.S)
    return block


def documented_launches_per_chunk() -> dict[str, int]:
    """Layout name -> launches/chunk, from the rows of the CPU kernel record that name a shipped layout."""
    (record,) = [r for r in json.loads(KERNEL_BENCH.read_text())["records"] if r["id"] == "cpu-kernels"]
    columns = record["table"]["columns"]
    assert columns[0] == "layout" and columns[-1] == "launches/chunk"
    rows = [(re.match(r"`([a-z0-9-]+)` ", row[0]), row[-1]) for row in record["table"]["rows"]]
    return {name.group(1): int(launches.split()[0]) for name, launches in rows if name}


def last_json(capsys) -> dict:
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_documented_layout_example_parses_and_plans_as_described(tmp_path, capsys) -> None:
    path = tmp_path / "documented-layout.json"
    path.write_text(documented_layout_file())
    assert main(["plan", "--layout", str(path), "--json"]) == 0
    summary = last_json(capsys)
    assert (summary["layout"], summary["mode"], summary["chunk_size"]) == ("gemma3-like", "bundled", 64)
    # group 0: layer 1's bf16 "kv" rows (576 x 2 B) and int8 "scale" rows (132 B), every token of the chunk;
    # group 1: layer 0's K and V (2 heads x 64 x 2 B each), only the 32-token sliding window of each chunk.
    # In block rows (the default) a row is a 16-token block: 4 a chunk, 2 for the window.
    assert [(tg["group"], tg["planes"], tg["layers"], tg["rows_per_chunk"], tg["bytes_per_chunk"])
            for tg in summary["transfer_groups"]] == [(0, 2, 1, 4, 64 * (576 * 2 + 132)), (1, 2, 1, 2, 32 * 256 * 2)]
    assert summary["launches_per_chunk"] == 2 and summary["multi_group"] is True
    assert summary["skipped_planes"] == 0


def test_documented_layout_example_round_trips_through_a_real_engine(tmp_path, capsys) -> None:
    path = tmp_path / "documented-layout.json"
    path.write_text(documented_layout_file())
    assert main(["selftest", "--layout", str(path), "--json"]) == 0
    result = last_json(capsys)
    assert result["bit_exact"] is True and result["rows_checked"] > 0
    assert result["chunks_stored"] == result["chunks_hit"] == 300 // 64  # whole chunks only: two groups


def test_layouts_page_lists_exactly_the_shipped_examples() -> None:
    text = LAYOUTS.read_text()
    listed = re.search(r"the name of a shipped example: (.*?) \(in `lmcache_platforms/examples/`\)", text, re.S)
    assert listed is not None
    assert sorted(re.findall(r"`([a-z0-9-]+)`", listed.group(1))) == example_names()


def test_measured_table_launches_per_chunk_are_the_plans() -> None:
    documented = documented_launches_per_chunk()
    assert set(documented) == {"llama8b", "deepseek-v4"}
    assert {name: plan(load_layout_spec(name), "bundled").launches_per_chunk for name in documented} == documented


@pytest.mark.slow
def test_deepseek_v4_moves_each_chunk_in_one_launch_per_saved_group() -> None:
    """Through our connector and a real LMCacheEngine (bench reports the same counter): bundled mode makes
    one kernel call per saved KV-cache group per chunk, both ways; the state group is not saved."""
    spec = load_layout_spec("deepseek-v4")
    layout = materialize(spec, "bundled", seed=5)
    saved = sorted({tg.group for tg in layout.transfer_groups})
    assert saved == [0, 1, 2] and {p.group for p in layout.skipped_planes} == {3}
    request = roundtrip.make_request(layout, 2 * spec.chunk_size, seed=5)
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, 2 * spec.chunk_size))
    with LayoutEngine(layout, storage) as engine:
        counters = engine.connector.binding.counters
        engine.store(request.tokens, request.store_ids)
        assert counters.chunks_stored == 2 and counters.launches == 2 * len(saved)
        assert engine.retrieve(request.tokens, request.load_ids) == 2 * spec.chunk_size
        assert counters.chunks_loaded == 2 and counters.launches == 4 * len(saved)
    assert documented_launches_per_chunk()["deepseek-v4"] == len(saved)
