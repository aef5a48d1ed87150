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


# What mutation testing (``make mutation``) found unread: each block table entry a load may write, every refusal
# of a snapshot load on its own, the block range of a failed load at its edges, the defaults a caller relies on,
# upstream's "next chunk boundary" rule after a partial save, and the multimodal identity in the keys.


def test_a_load_marks_exactly_the_blocks_vllm_holds_in_every_group_and_leaves_unsaved_groups_alone():
    plan = plan_groups(gemma_like().kv_cache_groups, PlatformSettings(skip_groups=("2",)))
    assert plan.saved == (0, 1, 3)
    t = tracker(256, [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20]])
    meta = build_request_meta(t, plan, CHUNK, load_spec=LoadSpec(64, 256, True))
    assert meta.blocks_not_held(64) == ((0, 0, 3, 4, 5, 6, 7, 8), (0, 0, 11, 12), (13, 14, 15, 16), (0, 0, 19, 20))
    assert meta.blocks_not_held(0) == meta.block_ids
    assert meta.blocks_not_held(10_000) == ((0,) * 8, (0,) * 4, (13, 14, 15, 16), (0,) * 4)


def test_a_snapshot_load_rewrites_only_its_own_table_and_keeps_the_attention_groups():
    """The snapshot group comes first in a GDN plan: the attention group after it still gets its table."""
    t = tracker(100, [[0, 0, 0, 9], [1, 2, 3, 4]])
    meta = build_request_meta(t, gdn_plan(), CHUNK, load_spec=LoadSpec(32, 64, True))
    assert meta.blocks_not_held(32, 64) == ((0, 9, 0, 0), (0, 2, 3, 4))
    assert meta.blocks_not_held(0, 32) == ((9, 0, 0, 0), (1, 2, 3, 4))  # a hit of one block: its snapshot


def _refusal(hit: int, step: int, blocks: int) -> str:
    return (f"request r: group 0 has no snapshot block for a hit of {hit} tokens resumed at step end {step} "
            f"({blocks} blocks of 32 tokens)")


@pytest.mark.parametrize(("hit", "step", "recurrent"), [
    (0, 100, [0, 0, 0, 9]),           # no hit: no snapshot to write
    (48, 100, [0, 0, 0, 9]),          # not on a block boundary
    (64, 129, [0, 0, 0, 9]),          # the step resumes in a block past the table
    (96, 40, [0, 9]),                 # the hit lies past the table (the step ends before it)
    (64, 130, [0, 0, 0, 0, 0]),       # the resume block is vLLM's null block
])
def test_each_snapshot_load_refusal_on_its_own(hit, step, recurrent):
    t = tracker(step, [recurrent, list(range(1, len(recurrent) + 1))])
    meta = build_request_meta(t, gdn_plan(), CHUNK, load_spec=LoadSpec(0, hit, True))
    with pytest.raises(ValueError) as refused:
        meta.blocks_not_held(0, hit)
    assert str(refused.value) == _refusal(hit, step, len(recurrent))


def test_no_hit_given_means_a_hit_of_zero_tokens():
    meta = build_request_meta(tracker(100, [[0, 0, 0, 9], [1, 2, 3, 4]]), gdn_plan(), CHUNK,
                              load_spec=LoadSpec(0, 64, True))
    with pytest.raises(ValueError) as refused:
        meta.blocks_not_held(0)
    assert str(refused.value) == _refusal(0, 100, 4)


def test_failed_blocks_at_the_edges_of_blocks_and_of_the_range():
    plan = plan_groups([group(["a"], full(128)), group(["c"], compressed(4))], PlatformSettings())
    t = tracker(512, [[1, 0, 3, 4], [5, 6, 7, 8]])
    meta = build_request_meta(t, plan, CHUNK, load_spec=LoadSpec(0, 512, True))
    assert meta.failed_blocks(0, 128) == {1, 5}        # ends on a block's end: the next block is not touched
    assert meta.failed_blocks(127, 129) == {1, 5, 6}   # one token either side of a boundary; block 0 is null
    assert meta.failed_blocks(130, 130) == set()       # an empty range, mid-block
    assert meta.failed_blocks(200, 100) == set()


def test_by_default_a_partial_last_chunk_is_not_saved_nor_a_decode_step():
    plan = single_group_plan(32)
    meta = build_request_meta(tracker(100, [[1, 2, 3, 4]]), plan, CHUNK)
    assert (meta.save_spec.num_tokens, meta.save_spec.can_save) == (64, True)
    decoding = tracker(130, [[1, 2, 3, 4, 5]], prompt_len=129, saved=64)
    decoding.is_decode_phase = True
    assert build_request_meta(decoding, plan, CHUNK) is None
    meta = build_request_meta(decoding, plan, CHUNK, save_decode_cache=True)
    assert (meta.save_spec.skip_leading_tokens, meta.save_spec.num_tokens) == (64, 128)


@pytest.mark.parametrize(("saved", "tokens", "expected"), [
    (64, 100, None), (63, 100, (63, 100)), (127, 128, (127, 128)), (1, 50, None), (1, 64, (1, 64))])
def test_after_a_save_the_next_one_waits_for_the_next_chunk_boundary(saved, tokens, expected):
    """Upstream's rule: once ``saved`` tokens are stored, nothing is saved until the tokens reach the first
    chunk boundary above them (a partial last chunk of the prompt included)."""
    meta = build_request_meta(tracker(tokens, [[1, 2, 3, 4]], saved=saved), single_group_plan(32), CHUNK,
                              discard_partial_chunks=False)
    got = None if meta is None else (meta.save_spec.skip_leading_tokens, meta.save_spec.num_tokens)
    assert got == expected


@pytest.mark.parametrize("skip", ["tracker", "step", "request"])
def test_each_skip_save_alone_stops_the_save_and_a_load_still_goes_out(skip):
    t = tracker(128, [[1, 2, 3, 4]])
    t.skip_save = skip == "tracker"
    t.request_configs = {"lmcache.skip_save": skip == "request", "lmcache.tag.user": "u1"}
    plan, force = single_group_plan(32), skip == "step"
    assert build_request_meta(t, plan, CHUNK, force_skip_save=force) is None
    meta = build_request_meta(t, plan, CHUNK, load_spec=LoadSpec(0, 64, True), force_skip_save=force)
    assert (meta.save_spec.can_save, meta.state_ends, len(meta.token_ids)) == (False, (), 128)
    assert meta.request_configs == t.request_configs
    t.skip_save, t.request_configs = False, {"lmcache.skip_save": False}
    assert build_request_meta(t, plan, CHUNK).save_spec.can_save


def test_the_step_end_locates_the_block_a_snapshot_load_resumes_from():
    """vLLM resumes from the block of the step's last token, which need not be the table's last."""
    meta = build_request_meta(tracker(70, [[0, 0, 9, 0], [1, 2, 3, 4]]), gdn_plan(), CHUNK,
                              load_spec=LoadSpec(0, 64, True))
    assert meta.step_tokens == 70
    assert meta.blocks_not_held(0, 64) == ((0, 9, 0, 0), (1, 2, 3, 4))


def test_a_plan_without_hits_never_saves_even_without_a_skip_setting():
    plan = plan_groups([group(["linear"], mamba()), group(["attn"], full())],
                       PlatformSettings(save_groups=("0",)), ALIGN)
    assert not plan.hits_allowed, plan.describe()
    assert build_request_meta(tracker(128, [[1, 2, 3, 4], [5, 6, 7, 8]]), plan, CHUNK) is None


def test_a_state_end_already_saved_is_not_saved_again():
    meta = build_request_meta(tracker(128, [[0, 5, 0, 7], [1, 2, 3, 4]], saved=64), gdn_plan(), CHUNK)
    assert (meta.save_spec.skip_leading_tokens, meta.state_ends) == (64, (128,))


def test_multimodal_items_change_the_tokens_the_keys_are_built_from():
    """vLLM gives every image the same placeholder ids: the keys must carry each item's hash instead, only
    within its placeholder span."""
    from vllm.multimodal.inputs import PlaceholderRange

    def keys(mm_hash: str) -> list[int]:
        t = tracker(128, [[1, 2, 3, 4]])
        t.mm_hashes, t.mm_positions = [mm_hash], [PlaceholderRange(offset=10, length=20)]
        return build_request_meta(t, single_group_plan(32), CHUNK).token_ids

    one, other = keys("a" * 64), keys("b" * 64)
    assert one[:10] == other[:10] == list(range(10)) and one[30:] == other[30:] == list(range(30, 128))
    assert len(one) == 128 and all(a != b for a, b in zip(one[10:30], other[10:30], strict=True))
    assert one[10:30] != list(range(10, 30))
