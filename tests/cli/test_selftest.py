"""`lmcache-platforms selftest`: a real LMCacheEngine round trip, JSON last line, exit 0/1/2, clean exit."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from lmcache_platforms.cli import selftest
from lmcache_platforms.kernels.registry import ENTRY_POINT_GROUP
from tests.faults.install import faulty_env, install_faulty_backend
from tests.fork_server import run_module, run_script

pytestmark = pytest.mark.slow

KEYS = {"layout", "bit_exact", "rows_checked", "chunks_stored", "chunks_hit", "transfer_groups",
        "launches_per_chunk", "backend"}


def run_env(**env: str) -> dict[str, str]:
    """This process's environment with a fixed hash seed, no usage tracking, and ``env``."""
    return {**os.environ, "PYTHONHASHSEED": "0", "LMCACHE_TRACK_USAGE": "false", **env}


def run_cli(*argv: str, **env: str) -> subprocess.CompletedProcess[str]:
    """The command in a fresh import state (a fork server's child), which must exit by itself (LMCache closed
    cleanly)."""
    return run_module("lmcache_platforms.cli.main", ["selftest", *argv], run_env(**env), timeout=300)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def run_in_process(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    selftest.add_arguments(parser)
    return selftest.run(parser.parse_args(argv))


def test_gemma3_is_bit_exact_and_the_process_exits() -> None:
    done = run_cli("--layout", "gemma3", "--json", LMCACHE_PLATFORMS_CHUNK_ROWS="tokens")
    assert done.returncode == 0, done.stderr[-2000:]
    result = last_json(done.stdout)
    assert set(result) >= KEYS
    assert result["layout"] == "gemma3" and result["bit_exact"] is True
    assert result["chunks_stored"] == result["chunks_hit"] == 4  # 300 tokens, 64-token chunks, whole only
    assert result["transfer_groups"] == result["launches_per_chunk"] == 2
    assert result["backend"] == "cpu"
    # 4 chunks: 64 full-attention rows + 32 window-tail rows, per plane (1 K + 1 V per layer, 1 and 5 layers)
    assert result["rows_checked"] == 4 * (64 * 2 + 32 * 2 * 5)


def test_gemma3_in_block_rows_is_bit_exact() -> None:
    """The default row unit: each layer's K and V pages merge into one plane, one row per 16-token block."""
    done = run_cli("--layout", "gemma3", "--json")
    assert done.returncode == 0, done.stderr[-2000:]
    result = last_json(done.stdout)
    assert result["bit_exact"] is True and result["chunks_hit"] == 4
    # 4 chunks: 4 full-attention blocks (1 layer) + a 32-token window's 2 blocks (5 layers), one plane a layer
    assert result["rows_checked"] == 4 * (4 * 1 + 2 * 5)


def test_triton_under_the_interpreter_in_exploded_mode() -> None:
    done = run_cli("--layout", "deepseek-v4-small", "--backend", "triton", "--mode", "exploded", "--json",
                   TRITON_INTERPRET="1")
    assert done.returncode == 0, done.stderr[-2000:]
    result = last_json(done.stdout)
    assert result["bit_exact"] is True and result["backend"] == "triton"
    assert result["launches_per_chunk"] == 4


@pytest.mark.parametrize(("argv", "message"), [
    (["--layout", "no-such-layout"], "no such layout file or example"),
    (["--layout", "llama", "--backend", "ascend"], "kernel backend 'ascend' is unavailable"),
])
def test_bad_input_is_one_line_on_stderr_and_exit_2(argv: list[str], message: str, capsys) -> None:
    assert run_in_process([*argv, "--json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("lmcache-platforms selftest:") and message in err[0]


def test_human_output_with_the_local_disk(tmp_path, capsys) -> None:
    assert run_in_process(["--layout", "llama", "--mode", "exploded", "--local-disk", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "layout llama (exploded, backend cpu): bit-exact" in out
    assert "chunks stored 5, hit 5" in out  # one group: the partial last chunk is stored too
    assert any(tmp_path.iterdir())


def test_not_bit_exact_exits_1(monkeypatch, capsys) -> None:
    failed = {"layout": "x", "mode": "bundled", "bit_exact": False, "rows_checked": 3, "chunks_stored": 1,
              "chunks_hit": 1, "transfer_groups": 1, "launches_per_chunk": 1, "backend": "cpu",
              "problems": ["chunk [0, 64) layer 'l' plane 'k': 1 of 3 rows differ, "
                           "first at chunk row 0 (slot 5), byte 0"]}
    monkeypatch.setattr(selftest, "selftest", lambda *args, **kwargs: failed)
    assert run_in_process(["--layout", "llama", "--json"]) == 1
    assert last_json(capsys.readouterr().out)["bit_exact"] is False


# --- The oracle against a faulty kernel backend, found by a real entry point in the selftest process ---

FAULT_LAYOUTS = ("gemma3", "deepseek-v4-small")
FAULTS = ("none", "flip", "shift", "zero", "swap")
# Counts and first problems below are in token rows (platforms.chunk_rows=tokens); in block rows (the
# default) each fault is still caught, with counts of block rows.
# (deepseek-v4-small's compress-32 group has one block row a chunk: nothing for `swap` to swap there.)
FAULT_CASES = [(layout, fault, "tokens") for layout in FAULT_LAYOUTS for fault in FAULTS] + [
    ("gemma3", fault, "blocks") for fault in ("none", "flip", "swap", "zero")] + [
    ("deepseek-v4-small", fault, "blocks") for fault in ("none", "flip", "zero")]
# `zero` drops the first block each launch loads into, in every plane: gemma3 has 16-row blocks in both
# groups (2 planes full attention, 10 sliding), so 4 chunks x 12 planes x 16 rows. deepseek-v4-small: the
# sliding group's 16-row blocks (4 planes), group 1's 4-row blocks (4 planes), group 2's 2-row blocks (2
# planes, 2 rows a chunk): 4 chunks x (64 + 16 + 4). The compressor_state planes (skipped state group) are
# moved by no launch, so no fault reaches them; the oracle still checks they stay all zero.
ZEROED_ROWS = {"gemma3": 4 * 12 * 16, "deepseek-v4-small": 4 * (4 * 16 + 4 * 4 + 2 * 2)}
# The first plane of the first transfer group, and its rows per chunk, which every first problem names.
FIRST_PLANE = {"gemma3": ("model.layers.5.self_attn", "k", 64), "deepseek-v4-small": ("model.layers.0.attn", "swa", 32)}


def first_load_slot(layout_name: str) -> int:
    """The slot selftest (seed 0) loads chunk row 0 of the first transfer group into: named by the problems."""
    from lmcache_platforms.layout import load_layout_spec
    from lmcache_platforms.tools import roundtrip
    from lmcache_platforms.tools.fixtures import materialize

    spec = load_layout_spec(layout_name)
    layout = materialize(spec, "bundled", seed=0)  # token rows, as the fault runs counted in them
    request = roundtrip.make_request(layout, spec.num_tokens, 0)
    return int(layout.chunk_slots(layout.transfer_groups[0], request.load_ids, 0, layout.chunk_size)[0])


def block_row_planes(layout_name: str) -> int:
    """Planes of every transfer group in block rows (a layer's K and V merged into its page where they tile)."""
    from lmcache_platforms.layout import load_layout_spec
    from lmcache_platforms.tools.fixtures import materialize

    layout = materialize(load_layout_spec(layout_name), "bundled", seed=0, rows="blocks")
    return sum(len(tg.planes) for tg in layout.transfer_groups)


def positive_control(plugin_path: Path, cwd: Path, layout: str, rows: str) -> subprocess.CompletedProcess[str]:
    """The installed console script in a fresh interpreter, in a directory outside the repository where only
    PYTHONPATH brings the plugin; it picks the backend through LMCACHE_PLATFORMS_KERNEL_BACKEND, as a vLLM server
    would, and runs it with no fault."""
    env = faulty_env(plugin_path, "none", run_env(LMCACHE_PLATFORMS_CHUNK_ROWS=rows))
    script = Path(sys.executable).with_name("lmcache-platforms")
    return subprocess.run([str(script), "selftest", "--layout", layout, "--json"], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def fault_series(plugin_path: Path, cwd: Path,
                 cases: list[tuple[str, str, str]]) -> dict[tuple[str, str, str], subprocess.CompletedProcess[str]]:
    """The faults, each naming the backend with --backend, in turn in one fork server child in the same outside
    directory (``tests/faults/selftest_series.py``: LMCache imported once for all of them)."""
    if not cases:
        return {}
    env = faulty_env(plugin_path, "none", run_env())
    series = Path(__file__).parents[1] / "faults" / "selftest_series.py"
    done = run_script(series.read_text(), env, timeout=600, cwd=cwd, input=json.dumps(cases))
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    return {case: subprocess.CompletedProcess(["selftest", *case], *runs["/".join(case)]) for case in cases}


@pytest.fixture(scope="module")
def fault_runs(request, tmp_path_factory) -> dict[tuple[str, str, str], subprocess.CompletedProcess[str]]:
    """Every selected (layout, fault, rows) selftest: the positive controls each in a fresh interpreter, beside
    one process running the faults in turn."""
    wanted = sorted({item.callspec.params["case"] for item in request.session.items
                     if "fault_runs" in getattr(item, "fixturenames", ()) and hasattr(item, "callspec")})
    plugin_path = install_faulty_backend(tmp_path_factory.mktemp("faulty-plugin"))
    cwd = tmp_path_factory.mktemp("faulty-cwd")
    controls = [case for case in wanted if case[1] == "none"]
    with ThreadPoolExecutor(max_workers=len(controls) + 1) as pool:
        futures = {case: pool.submit(positive_control, plugin_path, cwd, case[0], case[2]) for case in controls}
        faults = fault_series(plugin_path, cwd, [case for case in wanted if case[1] != "none"])
        return {**faults, **{case: future.result() for case, future in futures.items()}}


def test_the_faulty_backend_installs_as_a_distribution_with_an_entry_point(tmp_path) -> None:
    path = install_faulty_backend(tmp_path)
    (dist,) = importlib.metadata.distributions(path=[str(path)])
    (entry,) = dist.entry_points.select(group=ENTRY_POINT_GROUP)
    assert (entry.name, entry.value) == ("faulty", "lmcache_platforms_faulty_backend:FaultyBackend")
    assert (path / "lmcache_platforms_faulty_backend.py").is_file()


@pytest.mark.parametrize("case", FAULT_CASES, ids=[f"{layout}-{fault}-{rows}" for layout, fault, rows in FAULT_CASES])
def test_selftest_catches_each_fault_of_a_plugin_backend(case: tuple[str, str, str], fault_runs) -> None:
    layout, fault, rows_unit = case
    done = fault_runs[case]
    result = last_json(done.stdout)
    assert result["backend"] == "faulty", result  # found through the entry point, in a child process
    if fault == "none":  # positive control: the plugin path itself moves every row exactly
        assert done.returncode == 0, done.stderr[-2000:]
        assert result["bit_exact"] is True and result["problems"] == []
        assert result["mismatched_rows"] == result["touched_rows"] == 0
        return
    assert done.returncode == 1, done.stderr[-2000:]
    assert result["bit_exact"] is False
    chunks, launches = result["chunks_hit"], result["launches_per_chunk"]
    if rows_unit == "blocks":  # one block row per plane per launch: `zero` damages each plane's first one
        assert result["mismatched_rows"] == {"flip": chunks * launches, "swap": 2 * chunks * launches,
                                             "zero": chunks * block_row_planes(layout)}[fault]
        return
    layer, plane, rows = FIRST_PLANE[layout]
    differ, touched = {
        "flip": (chunks * launches, 0),  # one row per launch: the first plane's first row
        "swap": (2 * chunks * launches, 0),  # two rows per launch, swapped in the chunk buffer at store
        "zero": (ZEROED_ROWS[layout], 0),
        "shift": (result["rows_checked"], None),  # every row one slot off, spilling into rows no chunk holds
    }[fault]
    assert result["mismatched_rows"] == differ
    if touched is None:
        assert result["touched_rows"] > 0
    else:
        assert result["touched_rows"] == touched
    first_rows = {"flip": 1, "swap": 2, "zero": min(rows, 16), "shift": rows}[fault]
    # Every fault damages chunk row 0 of the first plane; flip touches byte 0 by construction, the others
    # replace random bytes (seed 0) that already differ at byte 0.
    assert result["problems"][0] == (
        f"chunk [0, 64) layer {layer!r} plane {plane!r}: {first_rows} of {rows} rows differ, first at chunk row 0 "
        f"(slot {first_load_slot(layout)}), byte 0"
    )
