"""Pass processes: results and progress come back, failures name their error, nothing outlives a pass."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmcache_platforms.tools.demo.runners import (
    LMCacheServer,
    PassFailed,
    PassRunner,
    Resources,
    base_env,
    free_port,
)
from tests.serving.processes import processes_mentioning

STUB = "tests.tools.demo.stub_pass"


def _runner(tmp_path: Path, messages: list[str], timeout_s: float = 60.0) -> PassRunner:
    return PassRunner(tmp_path, Resources.available(), messages.append, timeout_s=timeout_s)


def test_a_pass_returns_its_result_progress_and_log_warnings(tmp_path: Path) -> None:
    messages: list[str] = []
    result = _runner(tmp_path, messages).run("p1", {"behaviour": "ok"}, module=STUB)
    assert result["requests"] == []
    assert result["warnings"] == ["LMCache ERROR: LMCache is in DEGRADED MODE for the worker (test)"]
    assert messages == ["  [p1] step one", "  [p1] step two"]


def test_a_failed_pass_names_its_error_first(tmp_path: Path) -> None:
    with pytest.raises(PassFailed) as failed:
        _runner(tmp_path, []).run("p2", {"behaviour": "fail"}, module=STUB)
    first = str(failed.value).splitlines()[0]
    assert first == "pass p2 failed (exit 1): ValueError: Connector X does not support HMA but HMA is enabled."


def test_a_pass_past_its_time_limit_is_killed_with_its_children(tmp_path: Path) -> None:
    with pytest.raises(PassFailed, match="pass p3 ran past 3 s"):
        _runner(tmp_path, [], timeout_s=3).run("p3", {"behaviour": "hang"}, module=STUB)
    assert processes_mentioning(str(tmp_path)) == []
    assert processes_mentioning("time.sleep(600)") == []


def test_a_pass_that_hangs_after_its_results_is_killed_and_reported(tmp_path: Path) -> None:
    runner = _runner(tmp_path, [])
    runner.exit_grace_s = 1.0
    result = runner.run("p4", {"behaviour": "hang_at_exit"}, module=STUB)
    assert result["warnings"] == [
        "pass p4 had written its results but did not exit within 1 s (hung at exit); it was killed"
    ]
    assert processes_mentioning(str(tmp_path)) == []


def test_passes_get_one_process_per_engine_stable_hashing_and_explicit_cores() -> None:
    env = base_env(Resources((0, 1), kv_cache_gib=2))
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    assert env["PYTHONHASHSEED"] == "0"
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0,1"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "2"


def test_free_ports_are_usable_tcp_ports() -> None:
    assert 0 < free_port() < 65536


def test_a_missing_lmcache_cli_is_a_clear_server_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python"))
    server = LMCacheServer(tmp_path, Resources.available(), chunk_size=32)
    with pytest.raises(PassFailed, match=r"lmcache server cannot run: LMCache's command-line tool is not at "):
        server.__enter__()


@pytest.mark.parametrize(("inherited", "given"), [(None, "INFO"), ("WARNING", "INFO"), ("error", "INFO"),
                                                   ("DEBUG", "DEBUG"), ("info", "info")])
def test_passes_log_at_least_info_whatever_level_the_caller_set(
        monkeypatch: pytest.MonkeyPatch, inherited: str | None, given: str) -> None:
    """The demo reads INFO lines (groups, hits); a quieter level leaked from the caller once hid them."""
    if inherited is None:
        monkeypatch.delenv("LMCACHE_LOG_LEVEL", raising=False)
    else:
        monkeypatch.setenv("LMCACHE_LOG_LEVEL", inherited)
    assert base_env(Resources.available()).get("LMCACHE_LOG_LEVEL", "INFO") == given
