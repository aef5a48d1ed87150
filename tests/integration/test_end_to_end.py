"""Store, hit and load a hybrid (Gemma-3-like) model's KV through both connector halves and a real LMCache
engine, as vLLM drives them in one process; a hit loads while its request waits in vLLM's
WAITING_FOR_REMOTE_KVS state, and a short load is reported failed for that request alone.

Loads are checked on vLLM's own tensors as raw bytes, one slice per block id, without our layout code: the
whole cache after the load must equal the cache before it with exactly the expected destination blocks
replaced by their source blocks. A layout that skipped some bytes (V, a plane, a padding gap) or wrote a
block it must not (the null block 0, blocks of vLLM's prefix cache, blocks outside the request) fails it.
"""

from __future__ import annotations

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.request import Request

from lmcache_platforms.connector.parts import part_configs
from lmcache_platforms.integration.vllm import health
from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG, request_scope
from tests.integration.specs import gemma_like
from tests.integration.vllm_env import vllm_config
from tests.integration.vllm_stack import start_stack, stop_stack

pytestmark = pytest.mark.slow

WINDOW = 64
PROMPT = list(range(1000, 1200))
TABLE_A = ([1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20, 21],
           [22, 23, 24, 25, 26, 27, 28])
# After a 192-token hit vLLM gives the sliding groups null blocks (0) wholly before token 192 - 64.
TABLE_B = ([29, 30, 31, 32, 33, 34, 35, 36], [0, 0, 0, 0, 37, 38, 39, 40], [0, 0, 0, 0, 41, 42, 43, 44],
           [0, 0, 0, 0, 45, 46, 47, 48])


def output(new: list[NewRequestData], scheduled: dict[str, int], sync_loads: bool) -> SchedulerOutput:
    return SchedulerOutput(
        scheduled_new_reqs=new, scheduled_cached_reqs=CachedRequestData.make_empty(),
        num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
        scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
        free_encoder_mm_hashes=[], has_sync_kv_loads=sync_loads)


def kv_blocks(block_ids: tuple[list[int], ...]):
    """vLLM's allocation result for a block table (what update_state_after_alloc receives)."""
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in block_ids))


def admit(stack, req_id: str, prompt: list[int], block_ids: tuple[list[int], ...], vllm_hit: int = 0):
    """vLLM's scheduler for a new request: ask for external hits, allocate; a hit that waits for its load is
    left to the stack's next step (``stack.waiting``); the returned step schedules the rest of the prompt."""
    req = Request(req_id, prompt, SamplingParams(max_tokens=4), None)
    hit, waits = stack.scheduler.get_num_new_matched_tokens(req, vllm_hit)
    assert waits is (bool(hit) and stack.scheduler.impl.waits_for_loads)
    stack.scheduler.update_state_after_alloc(req, kv_blocks(block_ids), hit)
    if waits:
        stack.waiting.add(req_id)
    req.num_computed_tokens = vllm_hit + hit
    new = NewRequestData.from_request(req, block_ids)
    return hit, output([new], {req_id: len(prompt) - vllm_hit - hit}, sync_loads=bool(hit) and not waits)


@pytest.fixture(scope="module")
def hybrid(model_dir):
    health.forget()
    stack = start_stack(vllm_config(model_dir, "LMCachePlatformsConnector"), gemma_like(WINDOW, num_blocks=64))
    yield stack
    stop_stack(stack)


Blocks = dict[str, torch.Tensor]


def raw_blocks(stack) -> Blocks:
    """A copy of every layer's cache as raw bytes, one row per block id: ``[num_blocks, bytes per block]``."""
    return {name: cache.reshape(cache.shape[0], -1).view(torch.uint8).clone() for name, cache in stack.caches.items()}


def layers_of(stack, group: int) -> list[str]:
    return list(stack.kv_cache_config.kv_cache_groups[group].layer_names)


def with_copies(stack, before: Blocks, copies: dict[int, list[tuple[int, int]]]) -> Blocks:
    """``before`` with, in every layer of group g, block ``dst`` replaced by block ``src`` for each pair."""
    out = {name: blocks.clone() for name, blocks in before.items()}
    for group, pairs in copies.items():
        for name in layers_of(stack, group):
            for dst, src in pairs:
                out[name][dst] = before[name][src]
    return out


def differing_blocks(expected: Blocks, actual: Blocks) -> list[tuple[str, int]]:
    """(layer, block id) of every block whose bytes differ."""
    return [(name, int(b)) for name in expected
            for b in torch.nonzero((expected[name] != actual[name]).any(dim=1)).flatten()]


def pairs(dst: list[int], src: list[int], indices: range) -> list[tuple[int, int]]:
    return [(dst[i], src[i]) for i in indices]


def test_a_prefix_stored_by_one_request_is_loaded_into_anothers_blocks(hybrid):
    assert not health.is_degraded(), health.engine_health()
    hit, step = admit(hybrid, "a", PROMPT, TABLE_A)
    assert hit == 0
    hybrid.step(step, {"a": (PROMPT, TABLE_A)})
    assert hybrid.worker.impl.lmcache_engine.gpu_connector.binding.counters.chunks_stored == 3

    before = raw_blocks(hybrid)
    assert all(bool(before[name][TABLE_A[g][:6]].any(dim=1).all()) for g in range(4) for name in layers_of(hybrid, g))
    hit, step = admit(hybrid, "b", PROMPT[:192] + list(range(5000, 5040)), TABLE_B)
    assert hit == 192
    hybrid.step(step, {})
    assert hybrid.worker.impl.lmcache_engine.gpu_connector.binding.counters.chunks_loaded == 3
    after = raw_blocks(hybrid)

    # 192 tokens = 6 whole blocks of 32 in the full group; the sliding groups keep the window's last 64
    # tokens (blocks 4 and 5), their earlier blocks are null in TABLE_B. Nothing else may change.
    copies = {0: pairs(TABLE_B[0], TABLE_A[0], range(6))} | {g: pairs(TABLE_B[g], TABLE_A[g], range(4, 6))
                                                             for g in (1, 2, 3)}
    expected = with_copies(hybrid, before, copies)
    assert differing_blocks(expected, after) == []
    assert all(not bool(after[name][0].any()) for name in after)  # the null block 0: never written

    # Negative control: V dropped from one loaded block (each (block, head) page is [K rows][V rows]) must
    # be caught by this comparison, as must a write into the null block.
    name, block = layers_of(hybrid, 1)[0], TABLE_B[1][4]
    no_v = {n: blocks.clone() for n, blocks in after.items()}
    no_v[name][block, no_v[name].shape[1] // 2 :] = 0
    assert differing_blocks(expected, no_v) == [(name, block)]
    null_written = {n: blocks.clone() for n, blocks in after.items()}
    null_written[name][0, :2] = 1
    assert differing_blocks(expected, null_written) == [(name, 0)]


def test_only_what_vllm_lacks_is_loaded_after_its_own_prefix_hit(hybrid):
    """vLLM already holds the first 64 tokens (its prefix cache): LMCache loads chunks 2 and 3 only and
    never writes the blocks vLLM shares with other requests."""
    prompt = PROMPT[:192] + [9] * 20
    # blocks 0-1 of the full group are vLLM's cached prefix blocks (request a's), the rest are new
    table = ([1, 2, 49, 50, 51, 52, 53], [0, 0, 0, 0, 54, 55, 56], [0, 0, 0, 0, 57, 58, 59], [0, 0, 0, 0, 60, 61, 62])

    hit, step = admit(hybrid, "e", prompt, table, vllm_hit=64)
    assert hit == 128
    loaded_before = hybrid.worker.impl.lmcache_engine.gpu_connector.binding.counters.chunks_loaded
    before = raw_blocks(hybrid)
    hybrid.step(step, {})
    assert hybrid.worker.impl.lmcache_engine.gpu_connector.binding.counters.chunks_loaded == loaded_before + 2
    # full group: tokens 64-191 are blocks 2-5; sliding groups: the window's blocks 4 and 5. Blocks 1 and 2
    # (vLLM's prefix, shared with request a) and everything else keep their bytes.
    copies = {0: pairs(table[0], TABLE_A[0], range(2, 6))} | {g: pairs(table[g], TABLE_A[g], range(4, 6))
                                                              for g in (1, 2, 3)}
    assert differing_blocks(with_copies(hybrid, before, copies), raw_blocks(hybrid)) == []


def test_a_short_load_with_several_groups_is_reported_for_that_request_and_recomputed(hybrid):
    prompt = PROMPT[:192] + [7] * 10
    hit, _ = admit(hybrid, "c", prompt, TABLE_B)
    assert hit == 192
    engine = hybrid.worker.impl.lmcache_engine
    tags = hybrid.worker.impl._key_tags
    full_part = engine.gpu_connector.parts[0]  # chunks are stored in parts: drop the full-attention one
    keys = [key for _, _, key in engine.token_database.process_tokens(
        tokens=prompt[:192], request_configs=part_configs({SCOPE_TAG: request_scope(None, None), **tags}, full_part))]
    assert engine.storage_manager.remove(keys[-1])  # evicted between the lookup and the load
    hybrid.wait_for_loads()
    assert ("c" in hybrid.finished_loads, "c" in hybrid.failed_loads) == (True, True)
    assert engine.storage_manager.memcheck()

    # vLLM (policy "recompute") resets the request to 0 computed tokens and looks it up again: no hit is
    # claimed a second time, the whole prompt is computed and its chunks stored anew.
    req = Request("c", prompt, SamplingParams(max_tokens=4), None)
    assert hybrid.scheduler.get_num_new_matched_tokens(req, 0) == (0, False)
    hybrid.scheduler.update_state_after_alloc(req, kv_blocks(TABLE_A), 0)
    stored = hybrid.worker.impl.lmcache_engine.gpu_connector.binding.counters.chunks_stored
    hybrid.step(output([NewRequestData.from_request(req, TABLE_A)], {"c": len(prompt)}, sync_loads=False),
                {"c": (prompt, TABLE_A)})
    assert hybrid.worker.impl.lmcache_engine.gpu_connector.binding.counters.chunks_stored == stored + 3
    hit, _ = admit(hybrid, "c2", prompt, TABLE_B)
    assert hit == 192
    hybrid.wait_for_loads()
    assert "c2" not in hybrid.failed_loads
