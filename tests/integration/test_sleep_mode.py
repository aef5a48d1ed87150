"""vLLM 0.33 sleep mode (``unregister_kv_caches`` / ``restore_kv_caches`` / ``supports_sleep_mode``) on the
real stack: vLLM 0.32's config, Attention layers and CPU KV caches, a real LMCache engine, both connector
halves. vLLM 0.33 is not installed here, so the worker's calls are made as its ``sleep`` / ``wake_up`` make
them: unregister before the KV memory is unmapped, restore after it is mapped again.

What moved is measured twice: the binding's chunk counters and LMCache itself (a lookup finds what was
stored; vLLM's tensors, compared as raw bytes per block, show what was loaded).
"""

from __future__ import annotations

import pytest
import torch

from lmcache_platforms.integration.vllm import health
from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG, request_scope
from tests.integration.specs import gemma_like
from tests.integration.test_end_to_end import (
    TABLE_A,
    TABLE_B,
    WINDOW,
    admit,
    differing_blocks,
    layers_of,
    pairs,
    raw_blocks,
    with_copies,
)
from tests.integration.vllm_env import vllm_config
from tests.integration.vllm_stack import HEAD, single_group_stack, start_stack, stop_stack


def prompt(seed: int) -> list[int]:
    """200 tokens no other test of this module uses: three whole chunks of 64 are saved (several groups)."""
    return list(range(seed * 1000, seed * 1000 + 200))


def binding(stack):
    return stack.worker.impl.lmcache_engine.gpu_connector.binding


def moved(stack) -> tuple[int, int]:
    """(chunks stored, chunks loaded) so far, as the binding counts them."""
    counters = binding(stack).counters
    return counters.chunks_stored, counters.chunks_loaded


def stored_tokens(stack, tokens: list[int]) -> int:
    """How many leading tokens of ``tokens`` LMCache holds for a request without adapter or salt (the engine's
    lookups carry our layout tags)."""
    return stack.worker.impl.lmcache_engine.lookup(torch.tensor(tokens),
                                                   request_configs={SCOPE_TAG: request_scope(None, None)})


def assert_moved_nothing(before: tuple[int, int], after: tuple[int, int]) -> None:
    assert after == before, f"chunks (stored, loaded) went from {before} to {after}"


def save_step(stack, req_id: str, tokens: list[int], table=TABLE_A) -> None:
    """A prefill step of a request LMCache does not hold: the forward writes its K/V, the step saves it."""
    hit, step = admit(stack, req_id, tokens, table)
    assert hit == 0
    stack.step(step, {req_id: (tokens, table)})


def check_load(stack, req_id: str, tokens: list[int]) -> None:
    """``tokens`` stored from TABLE_A's blocks come back into TABLE_B's: exactly those blocks change."""
    hit, step = admit(stack, req_id, tokens[:192] + [7] * 10, TABLE_B)
    assert hit == 192
    loaded = moved(stack)[1]
    before = raw_blocks(stack)
    stack.step(step, {})
    assert moved(stack)[1] == loaded + 3
    copies = {0: pairs(TABLE_B[0], TABLE_A[0], range(6))} | {g: pairs(TABLE_B[g], TABLE_A[g], range(4, 6))
                                                             for g in (1, 2, 3)}
    assert differing_blocks(with_copies(stack, before, copies), raw_blocks(stack)) == []


def test_supports_sleep_mode_as_vllm_033_asks_it():
    """0.33's VllmConfig resolves the class through the factory and asks it before any connector exists."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
    from lmcache_platforms.integration.vllm.registration import register_connectors

    register_connectors()
    config = KVTransferConfig(kv_connector="LMCachePlatformsConnector", kv_role="kv_both")
    connector_class = KVConnectorFactory.get_connector_class(config)
    assert connector_class is LMCachePlatformsConnector
    assert "supports_sleep_mode" in connector_class.__dict__  # declared by us, not vLLM's default
    assert connector_class.supports_sleep_mode(config) is True
    for method in ("unregister_kv_caches", "restore_kv_caches"):
        assert method in connector_class.__dict__


def reallocate(caches: dict[str, torch.Tensor], storage: torch.UntypedStorage) -> None:
    """What a sleep backend that does not keep addresses would do: the same tensor objects, same shapes and
    strides, now over ``storage``."""
    for cache in caches.values():
        cache.set_(storage, cache.storage_offset(), cache.shape, cache.stride())


def plane_storages(stack) -> set[int]:
    return {p.storage.untyped_storage().data_ptr() for tg in binding(stack).layout.transfer_groups for p in tg.planes}


@pytest.mark.slow
class TestHybrid:
    """Four KV-cache groups (Gemma-3-like): a load that cannot happen stops the step."""

    @pytest.fixture(scope="class")
    def hybrid(self, model_dir):
        health.forget()
        stack = start_stack(vllm_config(model_dir, "LMCachePlatformsConnector"), gemma_like(WINDOW, num_blocks=64))
        yield stack
        stop_stack(stack)

    @pytest.fixture
    def asleep(self, hybrid):
        """Between vLLM's sleep and wake-up; woken (original tensors) whatever the test did."""
        originals = dict(hybrid.caches)
        hybrid.worker.unregister_kv_caches()
        yield hybrid
        hybrid.caches.update(originals)
        hybrid.worker.restore_kv_caches()
        assert binding(hybrid).released is None

    def test_after_unregister_a_save_step_moves_no_bytes_and_restore_brings_saves_back(self, hybrid):
        tokens = prompt(11)
        hybrid.worker.unregister_kv_caches()
        hybrid.worker.unregister_kv_caches()  # idempotent
        assert binding(hybrid).released is not None
        before = moved(hybrid)
        save_step(hybrid, "sleep-save", tokens)  # no error: a skipped save is a future miss, logged
        assert_moved_nothing(before, moved(hybrid))
        assert stored_tokens(hybrid, tokens) == 0

        hybrid.worker.restore_kv_caches()
        hybrid.worker.restore_kv_caches()  # idempotent
        assert binding(hybrid).released is None
        before = moved(hybrid)
        save_step(hybrid, "woken-save", tokens)
        assert moved(hybrid) == (before[0] + 3, before[1])
        assert stored_tokens(hybrid, tokens) == 192
        # Negative control: the assertion that passed while unregistered catches this step, which did store.
        with pytest.raises(AssertionError, match="chunks"):
            assert_moved_nothing(before, moved(hybrid))
        check_load(hybrid, "woken-load", tokens)

    def test_a_load_while_unregistered_writes_nothing_and_is_reported_failed(self, hybrid):
        tokens = prompt(12)
        save_step(hybrid, "stored-before-sleep", tokens)
        hybrid.worker.unregister_kv_caches()
        hit, _ = admit(hybrid, "load-asleep", tokens[:192] + [7] * 10, TABLE_B)
        assert hit == 192  # the scheduler never hears of sleep mode
        before_bytes, before = raw_blocks(hybrid), moved(hybrid)
        hybrid.wait_for_loads()  # vLLM recomputes (or fails) that request alone; rows never loaded are not read
        assert "load-asleep" in hybrid.failed_loads
        assert_moved_nothing(before, moved(hybrid))
        assert differing_blocks(before_bytes, raw_blocks(hybrid)) == []

        hybrid.worker.restore_kv_caches()
        check_load(hybrid, "load-woken", tokens)  # LMCache's chunks outlived the sleep

    def test_the_binding_refuses_a_store_lmcache_starts_itself_while_unregistered(self, hybrid):
        """LMCache's offload server calls the engine without the vLLM connector: the binding is the backstop."""
        from lmcache_platforms.kernels.contract import TransferError

        tokens = prompt(13)[:192]
        engine = hybrid.worker.impl.lmcache_engine
        tags = {SCOPE_TAG: request_scope(None, None), **hybrid.worker.impl._key_tags}  # a plain request's keys
        hybrid.worker.unregister_kv_caches()
        before = moved(hybrid)
        with pytest.raises(TransferError, match="released"):
            engine.store(torch.tensor(tokens), block_ids=TABLE_A, request_configs=tags)
        assert_moved_nothing(before, moved(hybrid))
        assert stored_tokens(hybrid, tokens) == 0
        hybrid.worker.restore_kv_caches()
        engine.store(torch.tensor(tokens), block_ids=TABLE_A, request_configs=tags)
        assert moved(hybrid)[0] == before[0] + 3 and stored_tokens(hybrid, tokens) == 192

    def test_a_kv_cache_moved_during_sleep_is_rebound_and_round_trips_bit_exact(self, asleep):
        tokens = prompt(14)
        old_binding, counted = binding(asleep), moved(asleep)
        first = next(iter(asleep.caches.values()))
        old_storage = first.untyped_storage()
        old_bytes = torch.empty(0, dtype=torch.uint8).set_(old_storage)
        old_snapshot = old_bytes.clone()
        # The new memory's contents are lost: garbage, not zeros.
        new_bytes = torch.full((old_bytes.numel(),), 0x5A, dtype=torch.uint8)
        reallocate(asleep.caches, new_bytes.untyped_storage())
        assert first.data_ptr() != old_bytes.data_ptr()

        asleep.worker.restore_kv_caches()
        rebound = binding(asleep)
        assert rebound is not old_binding and rebound.released is None
        assert rebound.fingerprint == old_binding.fingerprint  # same chunk format: earlier chunks still hit
        assert moved(asleep) == counted  # the counters carry over
        assert plane_storages(asleep) == {new_bytes.data_ptr()}
        asleep.worker.restore_kv_caches()  # idempotent: no second rebind
        assert binding(asleep) is rebound

        save_step(asleep, "moved-save", tokens)
        assert moved(asleep)[0] == counted[0] + 3
        check_load(asleep, "moved-load", tokens)
        assert torch.equal(old_bytes, old_snapshot)  # nothing of ours touched the old memory

        # Back to the original memory: rebound again, and what LMCache holds still loads there.
        asleep.worker.unregister_kv_caches()
        reallocate(asleep.caches, old_storage)
        asleep.worker.restore_kv_caches()
        assert plane_storages(asleep) == {old_bytes.data_ptr()}
        asleep.write_kv(tokens, TABLE_A)  # the forward writes the prefix's K/V there again (lost in sleep)
        check_load(asleep, "moved-back-load", tokens)

    def test_restore_refuses_a_kv_cache_whose_chunk_format_changed_naming_the_layer(self, asleep):
        name = layers_of(asleep, 1)[0]
        cache = asleep.caches[name]
        # Half the head size: other bytes per row, so other chunks than LMCache was set up for.
        asleep.caches[name] = torch.zeros(*cache.shape[:3], HEAD, dtype=cache.dtype)
        released = binding(asleep)
        with pytest.raises(RuntimeError, match=rf"(?s)layer '{name}'.*transfers stay off") as error:
            asleep.worker.restore_kv_caches()
        assert type(error.value).__name__ == "KVCacheMovedError"
        assert binding(asleep) is released and released.released is not None
        before = moved(asleep)
        hit, step = admit(asleep, "refused-save", prompt(15), TABLE_A)
        assert hit == 0
        asleep.step(step, {})  # a save step (the forward is left out: that layer is no longer a cache it knows)
        assert_moved_nothing(before, moved(asleep))

        asleep.caches[name] = cache  # back where it was bound: restore goes through, nothing rebound
        asleep.worker.restore_kv_caches()
        assert binding(asleep) is released and released.released is None
        save_step(asleep, "restored-save", prompt(15))
        assert moved(asleep)[0] == before[0] + 3


@pytest.mark.slow
class TestOneGroup:
    """One KV-cache group (hybrid manager off): a load that cannot happen is handed to vLLM to recompute."""

    @pytest.fixture(scope="class")
    def single(self, model_dir):
        yield from single_group_stack(model_dir, **{"platforms.load_mode": "sync"})

    def test_a_load_while_unregistered_moves_nothing_and_reports_the_blocks(self, single):
        tokens = prompt(16)
        table_a, table_b, table_c = ([1, 2, 3, 4, 5, 6, 7],), ([8, 9, 10, 11, 12, 13, 14, 15],), \
            ([16, 17, 18, 19, 20, 21, 22],)
        hit, step = admit(single, "one-a", tokens, table_a)
        single.step(step, {"one-a": (tokens, table_a)})
        single.worker.unregister_kv_caches()
        hit, step = admit(single, "one-b", tokens[:192] + list(range(5000, 5040)), table_b)
        assert hit == 192
        before_bytes, before = raw_blocks(single), moved(single)
        single.step(step, {})  # no error: vLLM recomputes what was not loaded
        assert_moved_nothing(before, moved(single))
        assert differing_blocks(before_bytes, raw_blocks(single)) == []
        assert single.worker.get_block_ids_with_load_errors() == {8, 9, 10, 11, 12, 13}  # tokens [0, 192)

        single.worker.restore_kv_caches()
        hit, step = admit(single, "one-c", tokens[:192] + [3] * 5, table_c)
        assert hit == 192
        single.step(step, {})
        assert moved(single)[1] == before[1] + 3
