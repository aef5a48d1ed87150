"""``bench --engine --idle-steps``: our connector's methods timed call by call, the outermost call only, and the
figure per scheduler step."""

from __future__ import annotations

import pytest

from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
from lmcache_platforms.tools import step_cost


def test_every_serving_method_of_our_connector_is_timed_and_no_lifecycle_one() -> None:
    timed = step_cost.timed_methods(LMCachePlatformsConnector)
    for name in ("build_connector_meta", "bind_connector_metadata", "start_load_kv", "wait_for_layer_load",
                 "save_kv_layer", "wait_for_save", "get_finished", "get_num_new_matched_tokens",
                 "update_state_after_alloc", "request_finished", "update_connector_output"):
        assert name in timed, name
    assert not {"register_kv_caches", "shutdown", "impl", "build_kv_connector_stats"} & set(timed)


class Nested:
    def outer(self) -> int:
        return self.inner() + 1

    def inner(self) -> int:
        return 1


def test_a_method_calling_another_is_counted_once_by_the_outer_one(monkeypatch) -> None:
    monkeypatch.setattr(step_cost, "TOTALS", step_cost.Totals())
    for name in ("outer", "inner"):
        monkeypatch.setattr(Nested, name, step_cost._timed(name, getattr(Nested, name)))
    assert Nested().outer() == 2
    assert Nested().inner() == 1
    assert step_cost.TOTALS.calls == {"outer": 1, "inner": 1}


def test_the_figure_is_per_scheduler_step() -> None:
    totals = {"seconds": {"build_connector_meta": 0.002, "save_kv_layer": 0.006, "get_finished": 0.0},
              "calls": {"build_connector_meta": 4, "save_kv_layer": 48, "get_finished": 4}}
    assert step_cost.per_step(totals, 0.2, 4) == {
        "idle_steps": 4, "idle_tokens": 4, "idle_connector_ms_per_step": pytest.approx(2.0),
        "idle_step_ms": pytest.approx(50.0), "idle_connector_share": pytest.approx(0.04),
        "idle_ms_per_step_build_connector_meta": pytest.approx(0.5),
        "idle_ms_per_step_save_kv_layer": pytest.approx(1.5)}
    assert step_cost.per_step({"seconds": {}, "calls": {}}, 0.2, 4) == {"idle_steps": 0}


def test_installed_then_put_back(monkeypatch) -> None:
    """The control: installed, the class's methods are the timed ones; the setter puts them back."""
    original = LMCachePlatformsConnector.build_connector_meta
    with monkeypatch.context() as patched:
        step_cost.install(patched.setattr)
        assert LMCachePlatformsConnector.build_connector_meta is not original
        assert LMCachePlatformsConnector.build_connector_meta.__wrapped__ is original
    assert LMCachePlatformsConnector.build_connector_meta is original
