"""A layerwise load in the step that computes its request (one KV-cache group, ``sync`` load mode), through the
connector halves vLLM builds and a real LMCache engine: a load whose store does not answer is given up at
``platforms.load_timeout_s`` while the forward waits for its first layer, its blocks are reported failed (vLLM
recomputes them), and the late answer writes nothing into them; the step's saves, running beside that load,
never unpin the chunks it is still reading."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.integration.test_end_to_end import PROMPT, admit
from tests.integration.vllm_stack import LAYERS, single_group_stack

pytestmark = pytest.mark.slow

LOAD_TIMEOUT_S = 1.0
TABLE_D = ([24, 25, 26, 27, 28, 29, 30, 31],)
TABLE_A, TABLE_B, TABLE_C = ([1, 2, 3, 4, 5, 6, 7],), ([8, 9, 10, 11, 12, 13, 14, 15],), ([16, 17, 18, 19, 20, 21,
                                                                                           22, 23],)


@pytest.fixture(scope="module")
def layerwise(model_dir):
    yield from single_group_stack(model_dir, **{"platforms.load_mode": "sync", "lmcache.use_layerwise": True,
                                                "platforms.load_timeout_s": LOAD_TIMEOUT_S})


def test_a_stuck_layerwise_load_is_given_up_at_its_deadline_and_its_late_answer_writes_nothing(layerwise,
                                                                                               monkeypatch):
    hit, step = admit(layerwise, "a", PROMPT, TABLE_A)
    layerwise.step(step, {"a": (PROMPT, TABLE_A)})
    assert layerwise.worker.impl.layerwise
    prompt = PROMPT[:192] + list(range(5000, 5040))
    hit, step = admit(layerwise, "b", prompt, TABLE_B)
    assert hit == 192
    engine = layerwise.worker.impl.lmcache_engine
    answer, answered = threading.Event(), threading.Event()
    manager = engine.storage_manager
    read = manager.batched_get  # the load's read from the tier: the store that does not answer

    def stuck(*args, **kwargs):
        answer.wait(60)
        try:
            return read(*args, **kwargs)
        finally:
            answered.set()

    monkeypatch.setattr(manager, "batched_get", stuck)
    untouched = layerwise.rows(0, TABLE_B[0], range(192))
    started = time.monotonic()
    layerwise.step(step, {})
    assert time.monotonic() - started < LOAD_TIMEOUT_S + 30  # bounded by the deadline, not by the store
    assert layerwise.worker.get_block_ids_with_load_errors() == {8, 9, 10, 11, 12, 13}  # tokens [0, 192)
    answer.set()
    assert answered.wait(60)
    assert torch.equal(layerwise.rows(0, TABLE_B[0], range(192)), untouched)

    # The control: the same hit loaded by a store that answers does write those rows.
    monkeypatch.setattr(manager, "batched_get", read)
    hit, step = admit(layerwise, "c", prompt, TABLE_C)
    layerwise.step(step, {})
    assert hit == 192 and layerwise.worker.get_block_ids_with_load_errors() == set()
    assert not torch.equal(layerwise.rows(0, TABLE_C[0], range(192)), untouched)


def test_the_step_saves_never_unpin_a_hit_its_layerwise_load_is_still_reading(layerwise, monkeypatch):
    """The forward marks every layer (each has vLLM's hook here) while the load is held: the store thread runs
    the step's saves to the end, and the hit's lookup pins stay until ``wait_for_save`` has the load's outcome."""
    prompt = PROMPT[:192] + list(range(6000, 6040))
    hit, step = admit(layerwise, "d", prompt, TABLE_D)  # PROMPT's chunks: stored by the test above
    assert hit == 192
    engine = layerwise.worker.impl.lmcache_engine
    answer, reading = threading.Event(), threading.Event()
    read = engine.storage_manager.batched_get

    def held(*args, **kwargs):
        reading.set()
        answer.wait(60)
        return read(*args, **kwargs)

    monkeypatch.setattr(engine.storage_manager, "batched_get", held)
    worker = layerwise.worker
    worker.bind_connector_metadata(layerwise.scheduler.build_connector_meta(step))
    try:
        worker.start_load_kv(SimpleNamespace(
            no_compile_layers=layerwise.vllm_config.compilation_config.static_forward_context))
        assert reading.wait(60)  # the load is reading its objects, held there
        assert "d" in engine.lookup_pins  # returned at once: every layer waits for itself
        for name in LAYERS:
            worker.save_kv_layer(name, None, None)
        worker.impl._store_job[1].result(timeout=60)  # the step's saves are done...
        assert "d" in engine.lookup_pins  # ...and left the pins of the load still running
        answer.set()
        worker.wait_for_save()
        assert "d" not in engine.lookup_pins
    finally:
        answer.set()
        worker.clear_connector_metadata()
