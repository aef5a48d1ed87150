"""`lmcache-platforms doctor` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess

import lmcache_platforms
from lmcache_platforms.cli import doctor
from lmcache_platforms.config import SETTINGS
from lmcache_platforms.connector import checksum
from tests.fork_server import run_module

VERSION_KEYS = {"python", "torch", "lmcache", "vllm", "vllm_ascend", "torch_npu", "ipex", "triton"}
# Every source a setting can come from, left out of the base environment so each run names its own.
SOURCE_VARIABLES = {s.env for s in SETTINGS} | {"LMCACHE_CONFIG_FILE", "LMCACHE_EXTRA_CONFIG"}
UNSET_SEED_WARNING = (
    "warning: PYTHONHASHSEED is unset: LMCache's chunk keys use Python's hash(), so chunks stored by one process "
    "miss in another (no hits across restarts or servers); export PYTHONHASHSEED=0 (or any fixed value) for every "
    "server sharing a store")


def _doctor(*args: str, unset: tuple[str, ...] = (), **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k not in SOURCE_VARIABLES and k not in unset}
    return run_module("lmcache_platforms.cli.main", ["doctor", *args], {**base, **env}, timeout=120)


def _settings_lines(stdout: str) -> dict[str, list[str]]:
    """The report's settings section: key -> [value, source words...]."""
    lines = stdout.splitlines()
    start = lines.index("settings:") + 1
    rows = [line.split() for line in lines[start:] if line.startswith("  ")]
    return {row[0]: row[1:] for row in rows}


def test_json_report_has_the_documented_keys():
    result = _doctor("--json", "--deep", PYTHONHASHSEED="0")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["version"] == lmcache_platforms.__version__
    assert report["activated"] is True
    assert report["platform"] == "cpu"
    assert set(report["versions"]) == VERSION_KEYS
    assert report["versions"]["lmcache"] == "0.5.6" and report["versions"]["torch_npu"] is None
    backends = {b["name"]: b for b in report["kernel_backends"]}
    assert backends["torch"]["available"] is True
    assert all(set(b) == {"name", "available", "reason"} for b in report["kernel_backends"])
    # The native library is built by `make setup`: the checksum is the CRC-32C, the way this CPU runs it named.
    assert report["checksum_hashing"] == checksum.hashing()
    assert report["checksum_hashing"].startswith("CRC-32C in native code, a ")
    applied = {p["target"]: p["applied"] for p in report["patches"]}
    assert applied["lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl"] is True
    assert "lmcache.v1.gpu_connector:CreateGPUConnector" not in applied  # our service factory gives our connector
    assert all(set(p) == {"target", "applied", "detail"} for p in report["patches"])
    assert report["connectors"] == {"state": "registered", "names": ["LMCachePlatformsConnector"]}
    assert report["upstream_adapter"] == "ours: upstream connector names run lmcache_platforms' engine impl"
    engine = "lmcache.v1.cache_engine:LMCacheEngine."
    assert [c["target"] for c in report["instance_changes"]] == [
        *(f"lmcache.v1.metadata:LMCacheMetadata.{m}" for m in ("get_shapes", "get_dtypes", "get_num_groups")),
        engine + "store", engine + "lookup", engine + "lookup"]
    assert all(set(c) == {"target", "when", "why"} and c["when"] and c["why"] for c in report["instance_changes"])
    assert list(report["settings"]) == [s.key for s in SETTINGS]
    assert all(entry["source"] == "default" for entry in report["settings"].values())
    assert report["settings"]["platforms.state_markers"] == {"value": ["State"], "source": "default"}
    assert report["settings"]["platforms.load_timeout_s"] == {"value": 10.0, "source": "default"}
    assert report["settings"]["platforms.poison_loads"] == {"value": False, "source": "default"}
    assert report["hash_seed"] == {"PYTHONHASHSEED": "0", "fixed": True, "warning": None}


def test_kept_upstream_adapter_is_reported_and_left_in_place():
    """The way out: upstream's impl stays under its name; our connector is still registered."""
    result = _doctor("--json", "--deep", LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER="1")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    adapter = {p["target"]: p for p in report["patches"]}[doctor.UPSTREAM_ADAPTER]
    assert (adapter["applied"], adapter["detail"]) == (
        False, "not applicable: upstream's kept: LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER is set")
    assert report["upstream_adapter"] == (
        "upstream's: only LMCachePlatformsConnector runs lmcache_platforms' engine impl (upstream's kept: "
        "LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER is set)")
    assert report["connectors"] == {"state": "registered", "names": ["LMCachePlatformsConnector"]}


def test_disabled_activation_is_reported_without_failing():
    """Also: a random hash seed is a warning in the JSON, not a failure."""
    result = _doctor("--json", LMCACHE_PLATFORMS_DISABLE="1", PYTHONHASHSEED="random")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0
    assert report["activated"] is False and report["disabled"] is True and report["patches"] == []
    seed = report["hash_seed"]
    assert (seed["PYTHONHASHSEED"], seed["fixed"]) == ("random", False)
    assert seed["warning"].startswith("PYTHONHASHSEED is random: LMCache's chunk keys use Python's hash()")


def test_each_setting_shows_its_value_and_source(tmp_path):
    """One run, every source, each beating the ones below it: kv_connector_extra_config > env > yaml > default."""
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nlocal_cpu: true\nmax_local_cpu_size: 1\nextra_config:\n"
                      "  platforms.chunk_rows: tokens\n  platforms.load_mode: async\n  platforms.mode: exploded\n")
    transfer = {"kv_connector": "LMCachePlatformsConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"platforms.mode": "bundled", "platforms.save_groups": "0,2",
                                              "lmcache.chunk_size": 16}}
    result = _doctor("--kv-transfer-config", json.dumps(transfer), PYTHONHASHSEED="0", LMCACHE_CONFIG_FILE=str(config),
                     LMCACHE_PLATFORMS_LOAD_MODE="sync", LMCACHE_PLATFORMS_DRAIN_TIMEOUT_S="7",
                     LMCACHE_PLATFORMS_SAVE_GROUPS="1")
    assert result.returncode == 0, result.stderr
    settings = _settings_lines(result.stdout)
    assert list(settings) == [s.key for s in SETTINGS]
    assert settings["platforms.chunk_rows"] == ["tokens", "yaml", str(config)]
    assert settings["platforms.load_mode"] == ["sync", "env", "LMCACHE_PLATFORMS_LOAD_MODE"]
    assert settings["platforms.drain_timeout_s"] == ["7.0", "env", "LMCACHE_PLATFORMS_DRAIN_TIMEOUT_S"]
    assert settings["platforms.mode"] == ["bundled", "kv_connector_extra_config"]
    assert settings["platforms.save_groups"] == ["0,2", "kv_connector_extra_config"]
    assert settings["platforms.skip_groups"] == ["(empty)", "default"]
    assert settings["platforms.chunk_parts"] == ["window", "default"]
    # The quick report: nothing imported to prove the patches, pending ones only counted, no seed warning with a
    # fixed seed.
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"lmcache_platforms {lmcache_platforms.__version__} (python ")
    assert "patches: 1 not applicable, 26 pending (each applies when its module is imported; --deep imports them " \
           "here)" in lines
    assert not [line for line in lines if line.startswith("  pending: ")]
    assert ("vLLM connectors: waiting for vLLM (registered when vLLM imports its connector factory; --deep imports "
            "it)") in lines
    assert "hash seed: PYTHONHASHSEED=0 (fixed: servers sharing it share chunks)" in lines
    assert not [line for line in lines if "warning" in line]
    assert "doctor: importing" not in result.stderr


def test_unset_hash_seed_warns_and_extra_config_variable_is_a_source():
    """LMCACHE_EXTRA_CONFIG (LMCache's JSON variable) as the extra_config source; with --deep, -v lists the
    patches applied in this process."""
    result = _doctor("-v", "--deep", unset=("PYTHONHASHSEED",),
                     LMCACHE_EXTRA_CONFIG='{"platforms.chunk_parts": "whole"}')
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert UNSET_SEED_WARNING in lines
    assert not [line for line in lines if line.startswith("hash seed:")]
    assert _settings_lines(result.stdout)["platforms.chunk_parts"] == ["whole", "LMCACHE_EXTRA_CONFIG"]
    assert ("  applied: lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl -> "
            "lmcache_platforms.integration.vllm.engine_impl:MultiGroupConnectorImpl") in lines


def test_an_invalid_setting_is_one_line_and_exit_1(tmp_path):
    config = tmp_path / "lmcache.yaml"
    config.write_text("chunk_size: 256\nextra_config:\n  platforms.chunk_row: tokens\n")
    cases = [
        ({"LMCACHE_CONFIG_FILE": str(config)}, [],
         "unknown setting 'platforms.chunk_row' in LMCache's extra_config; did you mean 'platforms.chunk_rows'?"),
        ({"LMCACHE_PLATFORMS_LOAD_TIMEOUT_S": "-1"}, [], "platforms.load_timeout_s must be >= 0, got '-1'"),
        ({}, ["--kv-transfer-config", '{"kv_connector_extra_config": {"platforms.mode": "flat"}}'],
         "platforms.mode must be one of bundled, exploded, got 'flat'"),
    ]
    for env, args, reason in cases:
        result = _doctor(*args, **env)
        assert result.returncode == 1, (env, args, result.stderr)
        assert result.stdout == ""
        assert [line for line in result.stderr.splitlines() if line.startswith("doctor: ")
                and not line.endswith("...")] == [f"doctor: invalid settings: {reason}"]
        assert "Traceback" not in result.stderr


def test_failed_patch_or_activation_error_means_exit_1():
    report = {"error": None, "patches": [{"target": "a:b", "applied": False, "detail": "failed: ImportError: x"}],
              "connectors": {"state": "registered"}}
    assert doctor.problems(report) == ["patch a:b: failed: ImportError: x"]
    report = {"error": "UnsupportedUpstreamVersion: installed lmcache 0.4.0 ...", "patches": [],
              "connectors": {"state": "waiting for vLLM"}}
    assert doctor.problems(report) == ["activation failed: UnsupportedUpstreamVersion: installed lmcache 0.4.0 ..."]
    report = {"error": None, "patches": [], "connectors": {"state": "registered"},
              "engines": [{"role": "worker", "stage": "init", "degraded": True, "reason": "No connector"}]}
    assert doctor.problems(report) == ["LMCache engine of the worker is in degraded mode (init: No connector)"]


def test_refused_activation_exits_1_with_the_reason(tmp_path):
    """A real refusal (package metadata says lmcache 0.4.0, tests/shadow_dist.py): exit 1, one stderr line."""
    from tests.shadow_dist import env_with, shadow_distribution

    result = run_module("lmcache_platforms.cli.main", ["doctor", "--json"],
                        env_with(shadow_distribution(tmp_path, "lmcache", "0.4.0")), timeout=120)
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["activated"] is False and report["versions"]["lmcache"] == "0.4.0"
    reason = ("activation failed: UnsupportedUpstreamVersion: installed lmcache 0.4.0 is not a version these "
              "patches know (known: ==0.5.6) (set LMCACHE_PLATFORMS_ALLOW_UNKNOWN_VERSIONS=1 to try anyway)")
    assert f"doctor: {reason}" in result.stderr.splitlines()


def test_a_platform_that_cannot_be_used_exits_1():
    result = _doctor(LMCACHE_PLATFORMS_DEVICE="tpu")
    assert result.returncode == 1
    assert "doctor: activation failed: PlatformError: unknown platform 'tpu'; known: npu, xpu, cuda, cpu" in \
        result.stderr.splitlines()
    assert result.stdout.splitlines()[1] == "activated: no   platform: unknown"
