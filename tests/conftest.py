"""Hypothesis profiles for the whole suite, loaded before any test module builds its ``settings``; and how the
suite is spread over pytest-xdist workers (``make test`` runs ``-n 2 --no-loadscope-reorder``).

``ci`` (the default, what ``make test`` runs) is derandomized: every run draws the same examples, so a
failure in CI reproduces on any machine with the same code and the same Hypothesis, and no example
database carries state between runs. ``dev`` keeps Hypothesis' random exploration (and its local
database) to hunt for new counterexamples; ``thorough`` is ``dev`` with ten times the examples. Choose
with ``HYPOTHESIS_PROFILE=ci|dev|thorough``.

The core properties (real-engine round trips of random layouts, the scheduler model, the connector's
stream order) take their example count from the profile, at least ``CORE_EXAMPLES`` in every one; tests
that name ``max_examples`` themselves keep their own count.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, settings

# Every engine the suite starts computes with the same threads, with or without a KV connector: vLLM's CPU worker
# binds one core and reserves the other without a connector but binds every core with one, and two threads reduce
# in another order than one, so answers compared across that difference drift. Each xdist worker's engines bind
# one core of their own (tests that need more, tensor parallelism, set it themselves).
_WORKER = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
_CORES = sorted(os.sched_getaffinity(0))
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(_CORES[_WORKER % len(_CORES)]))

# Every engine the suite starts loads into poisoned blocks (``platforms.poison_loads``): an answer compared with
# vLLM's own then proves the load, not a previous owner's identical bytes. Tests that read the cache's bytes
# themselves turn it off in their own configuration.
os.environ.setdefault("LMCACHE_PLATFORMS_POISON_LOADS", "1")

PROFILE_ENV = "HYPOTHESIS_PROFILE"
CORE_EXAMPLES = 100

settings.register_profile(
    "ci",
    derandomize=True,
    database=None,
    deadline=None,
    max_examples=CORE_EXAMPLES,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=CORE_EXAMPLES, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", parent=settings.get_profile("dev"), max_examples=10 * CORE_EXAMPLES)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))


# Modules whose tests share no module-scoped fixture and each start their own servers or fork-server children:
# spread test by test over the workers. Every other module runs whole on one worker, which builds its
# module-scoped fixtures (engines, served runs) once.
SPREAD_MODULES = {"tests/serving/test_upstream_names.py", "tests/test_import_orders.py"}
# Modules too long for one worker, split into groups of tests that share their module-scoped fixtures (test name
# prefix -> group); each group runs whole on one worker. Answers two groups need alike come from
# ``tests/session_cache.py``, computed once.
SPLIT_MODULES = {
    "tests/integration/test_recurrent_e2e.py": {
        "test_turn_": "turn-two", "test_vllms_own_": "turn-two", "test_layerwise_mode_": "turn-two",
        "test_a_long_prompt_": "long-branch-1",
        "test_at_budget_512_": "long-branch-2", "test_negative_control_a_state_from_": "long-branch-2",
        "test_negative_control_state_not_restored_": "a", "test_chunks_stored_whole_": "a", "test_a_cached_": "a",
        "test_another_hybrid_": "other-hybrid",
    },
    "tests/tools/demo/test_demo_e2e.py": {
        "test_served_warm_pass_": "served", "test_the_served_verdict_": "served",
        "test_served_layerwise_": "layerwise", "test_in_process_": "in-process", "test_vllm_refuses_": "in-process",
    },
}
# Seconds each slow scope takes on the 2-core CI machine (``--durations`` of a full run, rounded): the longest
# start first, so that the workers finish together instead of one running a long module alone at the end. Only
# the order matters; a scope not named here counts as short.
EXPECTED_SECONDS = {
    "tests/serving/test_readme_serving.py": 85,
    "tests/delivery/test_examples.py": 140,
    "tests/fuzz/test_fuzz_slice.py": 100,
    "tests/fuzz/test_first_repro.py": 110,
    "tests/upstream_fixes/test_patch_files.py": 45,
    "tests/connector/test_engine_round_trip.py": 75,
    "tests/integration/test_upstream_names_inprocess.py": 60,
    "tests/integration/test_recurrent_e2e.py::turn-two": 55,
    "tests/cli/test_selftest.py": 50,
    "tests/reliability/test_soak.py": 45,
    "tests/reliability/test_engine_faults.py": 40,
    "tests/tools/demo/test_demo_e2e.py::served": 40,
    "tests/platforms/test_stream_order.py": 40,
    "tests/integration/test_recurrent_e2e.py::long-branch-1": 35,
    "tests/integration/test_model_identity.py": 35,
    "tests/integration/test_recurrent_e2e.py::other-hybrid": 35,
    "tests/integration/test_request_scope.py": 30,
    "tests/connector/test_remote_round_trips.py": 30,
    "tests/tools/demo/test_demo_e2e.py::in-process": 30,
    "tests/integration/test_recurrent_e2e.py::long-branch-2": 30,
    "tests/integration/test_layerwise.py": 30,
    "tests/serving/test_shared_cluster.py": 30,
    "tests/upstream_fixes/test_remote_lookup.py": 30,
    "tests/tools/demo/test_demo_e2e.py::layerwise": 30,
    "tests/connector/test_redis_cluster.py": 25,
    "tests/integration/test_vllm023.py": 25,
    "tests/serving/test_upstream_names.py": 20,
    "tests/cli/test_bench_engine.py": 20,
    "tests/cli/test_refusals.py": 20,
    "tests/serving/test_recurrent_serving.py": 15,
    "tests/integration/test_recurrent_e2e.py::a": 15,
    "tests/serving/test_kv_router.py": 15,
    "tests/reliability/test_stuck_remote.py": 15,
    "tests/serving/test_connector_metrics.py": 15,
    "tests/integration/test_vllm_run.py": 10,
    "tests/serving/test_kv_events.py": 10,
    "tests/reliability/test_served_faults.py": 10,
}


def scope_of(nodeid: str) -> str:
    """The unit of work a worker runs whole: a module, a group of a split module, or one test of a spread one."""
    module, _, name = nodeid.partition("::")
    if module in SPREAD_MODULES:
        return nodeid
    for prefix, group in SPLIT_MODULES.get(module, {}).items():
        if name.startswith(prefix):
            return f"{module}::{group}"
    return module


def expected_seconds(scope: str) -> int:
    """A scope's expected time; the tests of a spread module each count as the module's figure."""
    module = scope.split("::", 1)[0]
    return EXPECTED_SECONDS.get(scope, EXPECTED_SECONDS.get(module, 0) if module in SPREAD_MODULES else 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Slow tests (real engines and servers) first, the longest scopes first among them, so that the workers
    finish together instead of one running the last server alone (``make test`` keeps this order:
    ``--no-loadscope-reorder``). The sort is stable: a scope's tests keep their order."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -expected_seconds(scope_of(item.nodeid))))


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """pytest-xdist's scope scheduling with ``scope_of`` as the scopes. (Its ``loadgroup`` marks do nothing under
    pytest 9: xdist 3.8 renames the items' ``_nodeid``, which pytest 9 no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return ModuleScheduling(config, log)


@pytest.fixture(scope="session", autouse=True)
def _tools_start_forked() -> Iterator[None]:
    """Every ``vllm serve`` and engine pass the tools start in this session is a child of a fork server that
    imported what it would import first (``tests/fork_launch.py``)."""
    from lmcache_platforms.tools.demo import runners
    from tests.fork_launch import start_forked

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(runners, "launch", start_forked)
        yield


# How many modules were loaded when the heap was last frozen (``_frozen_imports``).
_modules_at_freeze = 0
# New modules since then that make it worth one more full collection (~0.4 s with torch and vLLM loaded).
_MODULES_PER_FREEZE = 50
_engine_imports_done = False


def _import_what_an_engine_build_imports() -> None:
    """One small LMCache engine built and closed: LMCache imports some 4,000 modules (vLLM, transformers, ...)
    only when its first engine is built."""
    from lmcache_platforms.layout import load_layout_spec
    from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
    from lmcache_platforms.tools.fixtures import materialize

    layout = materialize(load_layout_spec("llama"), seed=0)
    LayoutEngine(layout, StorageOptions(max_local_cpu_size=cache_size_gib(layout, layout.chunk_size))).close()


@pytest.fixture(scope="module", autouse=True)
def _frozen_imports() -> None:
    """LMCacheEngine's constructor runs ``gc.collect()``, which walks the whole heap of the test process: with
    torch, vLLM and LMCache imported, ~0.4 s per engine the in-process tests build, hundreds of times a run. At a
    module's start (the previous module's fixtures torn down) with many modules imported since, the heap is
    collected once and frozen (``gc.freeze``): what survives is imported code and session state, never garbage,
    and later collections walk only what was created after it (~0 s). Before a module that builds engines in
    this process, one engine build imports the rest of what they import, so that it is frozen too. Frozen
    objects are still freed by reference counting; only cycles among them would outlive the session."""
    global _modules_at_freeze, _engine_imports_done
    if not _engine_imports_done and "lmcache_platforms.tools.engine" in sys.modules:
        _import_what_an_engine_build_imports()
        _engine_imports_done = True
    if len(sys.modules) >= _modules_at_freeze + _MODULES_PER_FREEZE:
        gc.collect()
        gc.freeze()
        _modules_at_freeze = len(sys.modules)


def pytest_sessionfinish() -> None:
    """The frozen heap back in the collector's reach, so that what it holds is torn down at exit as it would be
    without the freeze (extension modules check for leaked instances then)."""
    gc.unfreeze()
