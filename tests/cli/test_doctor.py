"""`lmcache-platforms doctor` as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess

from lmcache_platforms.cli import doctor
from tests.fork_server import run_module

VERSION_KEYS = {"python", "torch", "lmcache", "vllm", "vllm_ascend", "torch_npu", "ipex", "triton"}


def _doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return run_module("lmcache_platforms.cli.main", ["doctor", *args], {**os.environ, **env}, timeout=120)


def test_json_report_has_the_documented_keys():
    result = _doctor("--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["activated"] is True
    assert report["platform"] == "cpu"
    assert set(report["versions"]) == VERSION_KEYS
    assert report["versions"]["lmcache"] == "0.5.6" and report["versions"]["torch_npu"] is None
    backends = {b["name"]: b for b in report["kernel_backends"]}
    assert backends["torch"]["available"] is True
    assert all(set(b) == {"name", "available", "reason"} for b in report["kernel_backends"])
    applied = {p["target"]: p["applied"] for p in report["patches"]}
    assert applied["lmcache.integration.vllm.vllm_v1_adapter:LMCacheConnectorV1Impl"] is True
    assert applied["lmcache.v1.gpu_connector:CreateGPUConnector"] is True
    assert all(set(p) == {"target", "applied", "detail"} for p in report["patches"])
    assert report["connectors"] == {"state": "registered", "names": ["LMCachePlatformsConnector"]}
    assert report["upstream_adapter"] == "ours: upstream connector names run lmcache_platforms' engine impl"
    engine = "lmcache.v1.cache_engine:LMCacheEngine."
    assert [c["target"] for c in report["instance_changes"]] == [
        *(f"lmcache.v1.metadata:LMCacheMetadata.{m}" for m in ("get_shapes", "get_dtypes", "get_num_groups")),
        engine + "retrieve", engine + "store", engine + "retrieve", engine + "lookup", engine + "lookup",
        engine + "async_lookup_and_prefetch"]
    assert all(set(c) == {"target", "when", "why"} and c["when"] and c["why"] for c in report["instance_changes"])


def test_kept_upstream_adapter_is_reported_and_left_in_place():
    """The way out: upstream's impl stays under its name; our connector is still registered."""
    result = _doctor("--json", LMCACHE_PLATFORMS_KEEP_UPSTREAM_ADAPTER="1")
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
    result = _doctor("--json", LMCACHE_PLATFORMS_DISABLE="1")
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert result.returncode == 0
    assert report["activated"] is False and report["disabled"] is True and report["patches"] == []


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
    assert result.stdout.startswith("activated: False   platform: unknown")
