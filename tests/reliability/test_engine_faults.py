"""Faults planted between a cold pass (stores) and a warm pass (loads) of a real in-process vLLM engine (tiny
hybrid model: 3 sliding-window groups + 1 full-attention group) with our connector and a real LMCache backend,
``kv_load_failure_policy: recompute``. Each engine serves several scenarios (one prompt each, 64-token chunks).

Every scenario asserts: the engine survives (the run ends and reports), every request completes with the tokens
of vLLM without a connector, the failed load is reported exactly once with the tokens that did arrive, and the
recomputed request is stored anew (its next pass hits). Negative controls: a fault-free prompt (no failure
reported, all chunks loaded), and a kernel backend that zeroes a block silently (the answer differs: the
identity oracle does catch KV that is wrong and not reported).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.faults.install import faulty_env, install_faulty_backend
from tests.reliability.conftest import SHORT_LOAD, WRITE_FAILED, failed_loads, run_engine

pytestmark = pytest.mark.slow

# Whole chunks: these scenarios check that a load failing at chunk k keeps the hit before it. With chunk parts
# a failed load fails the whole hit (the window rows of a shorter hit were never read), which
# tests/connector/test_chunk_parts.py checks.
BASE = {"lmcache.chunk_size": 64, "lmcache.max_local_cpu_size": 0.5, "platforms.chunk_parts": "whole"}
# Room for exactly two chunks of this model (131136 bytes each: 131072 of KV, then the checksum trailer's column):
# the allocator is full after one short prompt.
TWO_CHUNKS_GIB = 0.0003


def short_load(log: list[str]) -> tuple[int, int, int]:
    """(tokens that arrived, tokens expected, first failed token) of the scenario's one failed load."""
    (line,) = failed_loads(log)
    match = SHORT_LOAD.search(line)
    assert match is not None, line
    return int(match[1]), int(match[2]), int(match[3])


def answers(result: dict[str, Any], phase: str) -> dict[str, list[int]]:
    return {a["name"]: a["tokens"] for a in result[phase]}


def assert_served_as_without_connector(result: dict[str, Any], reference: dict[str, list[int]]) -> None:
    for phase in ("cold", "warm"):
        for answer in result[phase]:
            assert answer["finish_reason"] == "length", (phase, answer)
            assert answer["tokens"] == reference[answer["name"]], (phase, answer["name"])
    for answer in result["again"]:
        assert answer["tokens"] == reference[answer["name"]], answer


def assert_stored_anew(result: dict[str, Any], hit_tokens: int) -> None:
    """The recomputed request was saved again: its next pass loads every chunk."""
    (again,) = result["again"]
    assert (again["lmcache_hit_tokens"], again["chunks_loaded"]) == (hit_tokens, hit_tokens // 64)


# ---------------------------------------------------------------- local CPU cache, kernel faults


@pytest.fixture(scope="module")
def cpu_run(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """LMCache's local CPU cache holding two chunks, kernels from the test's faulty backend (``none`` unless a
    scenario arms a fault)."""
    workdir = tmp_path_factory.mktemp("cpu")
    env = faulty_env(install_faulty_backend(workdir / "plugin"), "none")
    connector = {**BASE, "lmcache.local_cpu": True, "lmcache.max_local_cpu_size": TWO_CHUNKS_GIB}
    scenarios = [
        {"name": "full", "fault": "none", "again": 1},
        {"name": "ok/140", "fault": "none"},
        {"name": "kernel/140", "fault": "raise", "again": 1},
        {"name": "pinned/140", "fault": "none", "warm_others": ["rival"]},
        {"name": "zero/140", "fault": "zero"},  # last: it leaves wrong KV in vLLM's blocks
    ]
    return run_engine({"model": str(model), "connector": connector, "policy": "recompute",
                       "store": {"kind": "cpu"}, "scenarios": scenarios}, workdir, env)["scenarios"]


def test_the_engine_has_several_kv_cache_groups_and_a_clean_load_reports_no_failure(cpu_run, reference):
    """Positive control for the failure count: 2 whole chunks of a 140-token prompt load, nothing is reported."""
    ok = cpu_run["ok/140"]
    assert_served_as_without_connector(ok, reference)
    assert (ok["lmcache_hit_tokens"], ok["chunks_loaded"], ok["warm"][0]["num_cached_tokens"]) == (128, 2, 128)
    assert failed_loads(ok["log"]) == []


def test_a_full_allocator_skips_stores_and_the_request_is_served(cpu_run, reference):
    """Two chunks fit: the cold pass stores the first two of four (LMCache logs the memory pressure), the warm
    pass loads those and computes the rest."""
    full = cpu_run["full"]
    assert_served_as_without_connector(full, reference)
    assert full["cold_chunks_stored"] == 2
    assert (full["lmcache_hit_tokens"], full["chunks_loaded"]) == (128, 2)
    assert failed_loads(full["log"]) == []
    assert any("Failed to allocate memory block" in line for line in full["log"]), full["log"]


def test_a_kernel_error_on_one_chunk_is_one_failed_load_and_the_request_is_recomputed(cpu_run, reference):
    kernel = cpu_run["kernel/140"]
    assert_served_as_without_connector(kernel, reference)
    (line,) = failed_loads(kernel["log"])
    match = WRITE_FAILED.search(line)
    assert match is not None and match[1] == "128" and "TEST FAULT raise" in match[2], line
    # vLLM counts the hit it was promised, computes the prompt anyway, and nothing counts as loaded.
    assert (kernel["lmcache_hit_tokens"], kernel["chunks_loaded"], kernel["warm"][0]["num_cached_tokens"]) == (
        128, 0, 0)
    assert kernel["failed_causes"] == {"error": 1}
    assert_stored_anew(kernel, 128)


def test_a_looked_up_chunk_is_pinned_until_loaded_while_a_rival_needs_its_room(cpu_run, reference):
    """The cache is full with the looked-up prompt's chunks when a rival prompt in the same batch stores: the
    lookup's pins keep them (the rival's store gets what room there is), so the load is whole."""
    pinned = cpu_run["pinned/140"]
    assert_served_as_without_connector(pinned, reference)
    assert answers(pinned, "warm")["rival"] == reference["rival"]
    assert (pinned["lmcache_hit_tokens"], pinned["chunks_loaded"]) == (128, 2)
    assert (failed_loads(pinned["log"]), pinned["failed_causes"]) == ([], {})


def test_negative_control_silently_wrong_kv_changes_the_answer(cpu_run, reference):
    """The zeroing kernel reports nothing: the load counts as whole, and only the identity oracle sees it."""
    zero = cpu_run["zero/140"]
    assert zero["cold"][0]["tokens"] == reference["zero/140"]
    assert (zero["chunks_loaded"], failed_loads(zero["log"])) == (2, [])
    assert zero["warm"][0]["tokens"] != reference["zero/140"]


# ---------------------------------------------------------------- Redis


@pytest.fixture(scope="module")
def redis_run(model: Path, redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """LMCache's Redis remote backend behind a CPU cache that only allocates (``local_cpu: false``), so every
    warm load reads Redis; the run owns its redis-server (stopped and started again by one scenario)."""
    workdir = tmp_path_factory.mktemp("redis")
    connector = {**BASE, "lmcache.local_cpu": False, "lmcache.remote_serde": "naive"}
    scenarios = [
        {"name": "shape", "fault": "redis_shape", "chunk": 1, "again": 1},  # first: no earlier leak in its log
        {"name": "trunc", "fault": "redis_kv_bytes_truncate", "chunk": 2, "again": 1},
        {"name": "meta", "fault": "redis_metadata_garbage", "chunk": 1},
        {"name": "stop", "fault": "redis_stop", "again": 2},
        {"name": "garbage", "fault": "redis_kv_bytes_garbage", "chunk": 3, "again": 1},
    ]
    store = {"kind": "redis", "binary": redis_binary, "dir": str(workdir)}
    return run_engine({"model": str(model), "connector": connector, "policy": "recompute", "store": store,
                       "scenarios": scenarios}, workdir)["scenarios"]


@pytest.mark.redis
def test_a_redis_object_of_the_wrong_size_is_refused_and_its_references_released(redis_run, reference):
    """Chunk 1 rewritten as a well-formed object of half the size: LMCache hands it over as a hit; our size check
    refuses the load (one failure, nothing written) and LMCache's retrieve still releases every chunk."""
    shape = redis_run["shape"]
    assert_served_as_without_connector(shape, reference)
    (line,) = failed_loads(shape["log"])
    match = WRITE_FAILED.search(line)
    assert match is not None and match[1] == "256" and "holds 65536 bytes" in match[2], line
    assert shape["chunks_loaded"] == 0
    # Upstream's retrieve raised before releasing them (LMCache logs a buffer the collector frees with refs left).
    assert not [line for line in shape["log"] if "garbage collected with ref_count" in line], shape["log"]
    assert_stored_anew(shape, 256)


@pytest.mark.redis
def test_a_truncated_redis_value_fails_that_load_from_its_chunk(redis_run, reference):
    trunc = redis_run["trunc"]
    assert_served_as_without_connector(trunc, reference)
    assert short_load(trunc["log"]) == (128, 256, 128)
    assert (trunc["chunks_loaded"], trunc["failed_causes"]) == (2, {"missing": 1})
    # The catalog's redis_reads fix refuses the value before allocating (upstream raised after, keeping the buffer).
    assert any("holds 65568 bytes, its metadata says 131136: not loaded" in line for line in trunc["log"]), trunc["log"]
    assert_stored_anew(trunc, 256)


@pytest.mark.redis
def test_garbage_redis_metadata_fails_that_load_from_its_chunk(redis_run, reference):
    meta = redis_run["meta"]
    assert_served_as_without_connector(meta, reference)
    assert short_load(meta["log"]) == (64, 256, 64)
    assert meta["chunks_loaded"] == 1


@pytest.mark.redis
def test_redis_stopped_is_a_miss_and_started_again_is_used_again(redis_run, reference):
    """Stopped before the warm pass: lookups miss (no failed load), the stores fail and are logged; once it is
    back (empty), the next pass stores and the one after it loads every chunk."""
    stop = redis_run["stop"]
    assert_served_as_without_connector(stop, reference)
    assert (stop["lmcache_hit_tokens"], stop["chunks_loaded"], failed_loads(stop["log"])) == (0, 0, [])
    assert any("Remote connection failed in batched_contains" in line for line in stop["log"]), stop["log"]
    assert [(a["lmcache_hit_tokens"], a["chunks_loaded"]) for a in stop["again"]] == [(0, 0), (256, 4)]


@pytest.mark.redis
def test_same_size_garbage_in_a_redis_value_is_not_loaded(redis_run, reference):
    """Chunk 3's value overwritten with as many random bytes: LMCache 0.5.6 loaded it as KV. Its checksum fails
    before any byte is written, so the whole load reports no token, the object is removed from Redis, and the
    recomputed request stores it anew (its next pass loads every chunk)."""
    garbage = redis_run["garbage"]
    assert_served_as_without_connector(garbage, reference)
    assert short_load(garbage["log"]) == (0, 256, 0)
    assert (garbage["chunks_loaded"], garbage["failed_causes"]) == (0, {"corrupt": 1})
    assert any("fails its checksum" in line for line in garbage["log"]), garbage["log"]
    assert_stored_anew(garbage, 256)


# ---------------------------------------------------------------- layerwise, loads in the computing step


@pytest.fixture(scope="module")
def layerwise_run(model: Path, redis_binary: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """LMCache's ``use_layerwise`` with one KV-cache group (hybrid manager off) and the ``sync`` load mode: each
    warm load runs beside the forward, layer by layer, and a failure is reported per block. Redis behind an
    allocate-only CPU cache, kernels from the faulty backend."""
    workdir = tmp_path_factory.mktemp("layerwise")
    env = faulty_env(install_faulty_backend(workdir / "plugin"), "none")
    connector = {**BASE, "lmcache.local_cpu": False, "lmcache.remote_serde": "naive", "lmcache.use_layerwise": True,
                 "platforms.load_mode": "sync"}
    scenarios = [
        {"name": "ok/140", "fault": "none"},
        {"name": "kernel/140", "fault": "raise", "again": 1},
        {"name": "trunc", "fault": "redis_kv_bytes_truncate", "chunk": 2, "again": 1},
        {"name": "garbage", "fault": "redis_kv_bytes_garbage", "chunk": 3, "again": 1},
        {"name": "stop", "fault": "redis_stop", "again": 2},
    ]
    store = {"kind": "redis", "binary": redis_binary, "dir": str(workdir)}
    return run_engine({"model": str(model), "connector": connector, "policy": "recompute", "store": store,
                       "scenarios": scenarios, "single_group": True}, workdir, env)["scenarios"]


@pytest.mark.redis
def test_layerwise_loads_in_the_computing_step_and_every_fault_costs_a_recompute_only(layerwise_run, reference):
    ok = layerwise_run["ok/140"]
    assert_served_as_without_connector(ok, reference)
    assert (ok["lmcache_hit_tokens"], ok["chunks_loaded"], failed_loads(ok["log"])) == (128, 2, [])
    assert ok["layers_loaded"] == 4  # one load call, each of the model's 4 layers apart

    kernel = layerwise_run["kernel/140"]  # the first layer's launch raises: nothing of the load is trusted
    assert_served_as_without_connector(kernel, reference)
    (line,) = failed_loads(kernel["log"])
    match = WRITE_FAILED.search(line)
    assert match is not None and match[1] == "128" and "TEST FAULT raise" in match[2], line
    assert (kernel["chunks_loaded"], kernel["failed_causes"]) == (0, {"error": 1})
    assert_stored_anew(kernel, 128)

    trunc = layerwise_run["trunc"]
    assert_served_as_without_connector(trunc, reference)
    assert short_load(trunc["log"]) == (128, 256, 128)
    assert (trunc["chunks_loaded"], trunc["failed_causes"]) == (2, {"missing": 1})
    assert_stored_anew(trunc, 256)

    garbage = layerwise_run["garbage"]
    assert_served_as_without_connector(garbage, reference)
    assert short_load(garbage["log"]) == (0, 256, 0)
    assert (garbage["chunks_loaded"], garbage["failed_causes"]) == (0, {"corrupt": 1})
    assert_stored_anew(garbage, 256)

    stop = layerwise_run["stop"]
    assert_served_as_without_connector(stop, reference)
    assert (stop["lmcache_hit_tokens"], stop["chunks_loaded"], failed_loads(stop["log"])) == (0, 0, [])
    assert [(a["lmcache_hit_tokens"], a["chunks_loaded"]) for a in stop["again"]] == [(0, 0), (256, 4)]


# ---------------------------------------------------------------- local disk and fs:// files


@pytest.fixture(scope="module")
def disk_run(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """LMCache's local disk backend (one ``.pt`` file per chunk) behind an allocate-only CPU cache."""
    workdir = tmp_path_factory.mktemp("disk")
    store = workdir / "store"
    store.mkdir()
    connector = {**BASE, "lmcache.local_cpu": False, "lmcache.local_disk": f"file://{store}/",
                 "lmcache.max_local_disk_size": 1}
    scenarios = [
        {"name": "deleted", "fault": "file_delete", "chunk": 2, "again": 1},
        {"name": "cut", "fault": "file_truncate", "chunk": 0, "again": 1},
        {"name": "one/100", "fault": "file_delete", "chunk": 0, "again": 1},
    ]
    return run_engine({"model": str(model), "connector": connector, "policy": "recompute",
                       "store": {"kind": "disk", "dir": str(store)}, "scenarios": scenarios}, workdir)["scenarios"]


def test_a_deleted_disk_file_fails_that_load_from_its_chunk(disk_run, reference):
    deleted = disk_run["deleted"]
    assert_served_as_without_connector(deleted, reference)
    assert short_load(deleted["log"]) == (128, 256, 128)
    assert deleted["chunks_loaded"] == 2
    assert any("File not found on disk" in line for line in deleted["log"]), deleted["log"]
    assert_stored_anew(deleted, 256)


def test_a_disk_file_cut_short_is_never_loaded(disk_run, reference):
    """Upstream read half a file into a whole chunk's buffer and loaded it (the rest: stale bytes); the catalog's
    disk_reads fix refuses it (a failure from chunk 0) and drops the chunk, so the recomputation stores it anew."""
    cut = disk_run["cut"]
    assert_served_as_without_connector(cut, reference)
    assert short_load(cut["log"]) == (0, 256, 0)
    assert cut["chunks_loaded"] == 0
    assert any("holds 65568 bytes, the chunk 131136" in line for line in cut["log"]), cut["log"]
    assert_stored_anew(cut, 256)


def test_the_single_chunk_disk_read_of_a_deleted_file_is_a_failure_not_stale_bytes(disk_run, reference):
    """A one-chunk load takes upstream's single-key path, which returned the unread buffer as a hit."""
    one = disk_run["one/100"]
    assert_served_as_without_connector(one, reference)
    assert short_load(one["log"]) == (0, 64, 0)
    assert any("the chunk's file is missing" in line for line in one["log"]), one["log"]
    assert_stored_anew(one, 64)


@pytest.fixture(scope="module")
def fs_run(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """LMCache's ``fs://`` remote backend (one ``.data`` file per chunk, what the demo uses)."""
    workdir = tmp_path_factory.mktemp("fs")
    store = workdir / "store"
    store.mkdir()
    connector = {**BASE, "lmcache.local_cpu": False, "lmcache.remote_url": f"fs://localhost:0{store}",
                 "lmcache.remote_serde": "naive"}
    scenarios = [
        {"name": "deleted", "fault": "file_delete", "chunk": 2, "again": 1},
        {"name": "cut", "fault": "file_truncate", "chunk": 0, "again": 1},
    ]
    return run_engine({"model": str(model), "connector": connector, "policy": "recompute",
                       "store": {"kind": "fs", "dir": str(store)}, "scenarios": scenarios}, workdir)["scenarios"]


def test_a_deleted_fs_file_shortens_the_hit(fs_run, reference):
    """The fs backend's lookup looks at the files, so a deleted chunk is a miss from there on, not a failure."""
    deleted = fs_run["deleted"]
    assert_served_as_without_connector(deleted, reference)
    assert (deleted["lmcache_hit_tokens"], deleted["chunks_loaded"], failed_loads(deleted["log"])) == (128, 2, [])
    assert_stored_anew(deleted, 256)


def test_an_fs_file_cut_short_fails_that_load(fs_run, reference):
    cut = fs_run["cut"]
    assert_served_as_without_connector(cut, reference)
    assert short_load(cut["log"]) == (0, 256, 0)
    assert any("Partial read" in line for line in cut["log"]), cut["log"]
    assert_stored_anew(cut, 256)


# ---------------------------------------------------------------- policy fail, in-process


@pytest.fixture(scope="module")
def fail_run(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The local disk store with vLLM's ``fail`` policy; the victim and a bystander are batched together."""
    workdir = tmp_path_factory.mktemp("fail")
    store = workdir / "store"
    store.mkdir()
    connector = {**BASE, "lmcache.local_cpu": False, "lmcache.local_disk": f"file://{store}/",
                 "lmcache.max_local_disk_size": 1}
    scenarios = [{"name": "victim", "fault": "file_delete", "chunk": 1, "others": ["bystander"], "again": 1}]
    return run_engine({"model": str(model), "connector": connector, "policy": "fail",
                       "store": {"kind": "disk", "dir": str(store)}, "scenarios": scenarios}, workdir)["scenarios"]


def test_policy_fail_ends_only_the_request_whose_load_failed(fail_run, reference):
    """``LLM.generate`` returns the victim with finish reason ``error`` and no tokens; the bystander, loaded in
    the same batch, has its no-connector tokens. Sent again, the victim loads the chunk left (chunk 0)."""
    victim = fail_run["victim"]
    assert answers(victim, "cold") == {"victim": reference["victim"], "bystander": reference["bystander"]}
    failed, bystander = victim["warm"]
    assert (failed["name"], failed["finish_reason"], failed["tokens"]) == ("victim", "error", [])
    assert (bystander["finish_reason"], bystander["tokens"]) == ("length", reference["bystander"])
    assert bystander["num_cached_tokens"] == 256
    assert short_load(victim["log"]) == (64, 256, 64)
    assert (victim["lmcache_hit_tokens"], victim["chunks_loaded"]) == (512, 5)  # 4 of the bystander's, 1 victim's
    (again,) = victim["again"]
    assert (again["tokens"], again["lmcache_hit_tokens"], again["chunks_loaded"]) == (reference["victim"], 64, 1)
