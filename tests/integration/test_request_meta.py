"""Per-step request metadata: saving rules for hybrid models, slots per group, failed blocks per group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.groups import plan_groups, single_group_plan
from lmcache_platforms.integration.vllm.request_meta import LoadSpec, build_request_meta, first_savable_token
from lmcache_platforms.integration.vllm.tracker import RequestTracker
from lmcache_platforms.layout.slots import chunk_slots
from tests.integration.specs import compressed, full, gemma_like, group, mamba

CHUNK = 64


def tracker(tokens: int, block_ids: list[list[int]], prompt_len: int | None = None, saved: int = 0):
    return RequestTracker(req_id="r", prompt_len=prompt_len or tokens, token_ids=list(range(tokens)),
                          block_ids=block_ids, num_saved_tokens=saved)


def test_hybrid_saves_only_whole_chunks_even_at_the_end_of_the_prompt():
    plan = plan_groups(gemma_like().kv_cache_groups, PlatformSettings())
    t = tracker(100, [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]])
    meta = build_request_meta(t, plan, CHUNK, discard_partial_chunks=False)
    assert meta.save_spec.can_save and meta.save_spec.num_tokens == 64
    assert t.num_saved_tokens == 64
    assert meta.block_ids == ((1, 2, 3, 4), (5, 6, 7, 8), (9, 10, 11, 12), (13, 14, 15, 16))
    # the next step crosses no new chunk boundary: nothing to do
    t.append(list(range(100, 110)), None)
    assert build_request_meta(t, plan, CHUNK) is None


def test_single_group_keeps_upstream_partial_chunk_rule():
    plan = single_group_plan(32)
    meta = build_request_meta(tracker(100, [[1, 2, 3, 4]]), plan, CHUNK, discard_partial_chunks=False)
    assert meta.save_spec.num_tokens == 100
    assert meta.block_ids == ((1, 2, 3, 4),)


def test_chunks_with_rows_in_the_null_block_are_never_saved():
    # sliding window 64: chunk [0,64) needs rows 0..63, chunk [64,128) rows 64..127, both whole blocks here.
    plan = plan_groups(gemma_like(window=64).kv_cache_groups, PlatformSettings())
    ids = [[1, 2, 3, 4, 5, 6], [0, 0, 7, 8, 9, 10], [0, 0, 11, 12, 13, 14], [0, 0, 15, 16, 17, 18]]
    t = tracker(192, ids)
    assert first_savable_token(plan.saved_groups, ids, 0, 192, CHUNK) == 64
    meta = build_request_meta(t, plan, CHUNK)
    assert meta.save_spec.skip_leading_tokens == 64 and meta.save_spec.num_tokens == 192


def test_window_smaller_than_chunk_needs_only_its_tail():
    plan = plan_groups(gemma_like(window=32).kv_cache_groups, PlatformSettings())
    ids = [[1, 2], [0, 3], [0, 4], [0, 5]]  # block 0 of the sliding groups already freed
    assert first_savable_token(plan.saved_groups, ids, 0, 64, CHUNK) == 0


def test_failed_blocks_use_each_groups_own_block_size():
    plan = plan_groups([group(["a"], full(128)), group(["c"], compressed(4))], PlatformSettings())
    # group 0: 128 tokens per block; group 1: 32 rows x 4 tokens = 128 tokens per block as well
    t = tracker(512, [[1, 2, 3, 4], [5, 6, 7, 8]])
    meta = build_request_meta(t, plan, CHUNK, load_spec=LoadSpec(0, 512, True))
    assert meta.failed_blocks(256, 512) == {3, 4, 7, 8}
    assert meta.failed_blocks(130, 131) == {2, 6}


def test_load_only_request_and_decode_phase():
    plan = plan_groups(gemma_like().kv_cache_groups, PlatformSettings())
    t = tracker(130, [[1, 2, 3, 4, 5]] * 4, prompt_len=129, saved=128)
    t.is_decode_phase = True
    assert build_request_meta(t, plan, CHUNK) is None
    meta = build_request_meta(t, plan, CHUNK, load_spec=LoadSpec(0, 128, True))
    assert not meta.save_spec.can_save and len(meta.token_ids) == 128


ALIGN = CHUNK


def gdn_plan():
    """A GDN hybrid as vLLM groups it in align mode: a recurrent group and a full-attention group, 32 tokens
    per block, 64-token chunks."""
    return plan_groups([group(["linear"], mamba(mode="align")), group(["attn"], full())], PlatformSettings(), ALIGN)


@settings(max_examples=80, deadline=None)
@given(st.integers(1, 6), st.integers(0, 6), st.integers(1, 100), st.data())
def test_a_load_puts_the_hit_snapshot_where_vllm_resumes(hit_chunks, held_blocks, scheduled, data):
    """vLLM (align mode) resumes a request with N computed tokens from block ``cdiv(N + scheduled, bs) - 1``
    after copying block ``N // bs - 1`` into it (its null block for tokens LMCache brought): the snapshot at N
    must land in the first, and no other snapshot may be written."""
    hit = hit_chunks * CHUNK
    vllm_cached = min(held_blocks * 32, hit - 32)
    step_end = hit + scheduled
    num_blocks = -(-step_end // 32)
    resume_block = 1000 + data.draw(st.integers(0, 50))
    recurrent = [0] * (num_blocks - 1) + [resume_block]
    attention = list(range(1, num_blocks + 1))
    t = tracker(step_end, [recurrent, attention])
    meta = build_request_meta(t, gdn_plan(), CHUNK, load_spec=LoadSpec(vllm_cached, hit, True))
    ids = meta.blocks_not_held(vllm_cached, hit)
    snapshot = gdn_plan().groups[0]
    written = {c0: chunk_slots(snapshot, ids[0], c0, c0 + CHUNK, CHUNK).tolist()
               for c0 in range(vllm_cached // CHUNK * CHUNK, hit, CHUNK)}
    assert written[hit - CHUNK] == [resume_block]
    assert all(slots == [-1] for c0, slots in written.items() if c0 != hit - CHUNK)


def test_a_snapshot_load_without_its_resume_block_is_refused():
    t = tracker(130, [[0, 0, 0, 0, 9], list(range(1, 6))])
    meta = build_request_meta(t, gdn_plan(), CHUNK, load_spec=LoadSpec(0, 100, True))
    with pytest.raises(ValueError, match="request r: group 0 has no snapshot block for a hit of 100 tokens"):
        meta.blocks_not_held(0, 100)


def test_recurrent_groups_save_every_chunk_and_a_state_where_a_step_ended_on_its_end():
    """vLLM keeps the state only where a step ended (its block; the blocks a step ran past are null): every
    whole chunk's attention is saved, its state part only at those ends."""
    plan = gdn_plan()
    meta = build_request_meta(tracker(128, [[0, 0, 0, 7], [1, 2, 3, 4]]), plan, CHUNK)
    assert meta.save_spec.can_save and (meta.save_spec.skip_leading_tokens, meta.save_spec.num_tokens) == (0, 128)
    assert meta.state_ends == (128,)
    meta = build_request_meta(tracker(150, [[0, 5, 0, 7, 9], [1, 2, 3, 4, 5]]), plan, CHUNK)
    assert (meta.save_spec.num_tokens, meta.state_ends) == (128, (64, 128))  # 64: an internal checkpoint
    meta = build_request_meta(tracker(100, [[0, 0, 7], [1, 2, 3]]), plan, CHUNK)
    assert (meta.save_spec.num_tokens, meta.state_ends) == (64, ())  # the step ended mid-chunk


def test_state_ends_are_those_of_this_step_only():
    plan = gdn_plan()
    t = tracker(64, [[0, 4], [1, 2]])
    assert build_request_meta(t, plan, CHUNK).state_ends == (64,)
    t.append(list(range(64, 128)), [[0, 8], [3, 4]])
    assert t.step_start == 64
    meta = build_request_meta(t, plan, CHUNK)
    assert (meta.save_spec.skip_leading_tokens, meta.state_ends) == (64, (128,))
    t.append(list(range(128, 129)), [[0], [5]])  # decode: nothing new to save
    assert build_request_meta(t, plan, CHUNK) is None


def test_a_chunk_without_its_state_is_still_saved_for_its_attention():
    """The old rule (no chunk saved past a null snapshot block) left nothing to hit at large step budgets."""
    meta = build_request_meta(tracker(192, [[0, 0, 0, 0, 0, 6], [1, 2, 3, 4, 5, 6]]), gdn_plan(), CHUNK)
    assert (meta.save_spec.skip_leading_tokens, meta.save_spec.num_tokens, meta.state_ends) == (0, 192, (192,))
