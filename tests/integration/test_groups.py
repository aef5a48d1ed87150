"""Which vLLM groups are saved, skipped (provably unneeded) or unrestorable (then no hits at all)."""

from __future__ import annotations

import pytest
from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.groups import plan_groups, tokens_per_row
from lmcache_platforms.integration.vllm.recurrent import chunk_size_for, state_ends
from tests.integration.specs import BLOCK, compressed, full, gemma_like, group, mamba, sliding

DEFAULT = PlatformSettings()


def test_gemma_like_saves_every_group_with_its_window():
    plan = plan_groups(gemma_like(window=64).kv_cache_groups, DEFAULT)
    assert plan.saved == (0, 1, 2, 3)
    assert plan.multi_group and plan.hits_allowed
    assert [g.sliding_window for g in plan.groups] == [None, 64, 64, 64]
    assert [g.block_size for g in plan.groups] == [32] * 4
    assert plan.groups[1].layer_names == ("model.layers.0.self_attn.attn",)


def test_compressed_group_counts_rows_not_tokens():
    plan = plan_groups([group(["a"], full(128)), group(["c"], compressed(4))], DEFAULT)
    assert tokens_per_row(compressed(4)) == 4
    assert (plan.groups[1].block_size, plan.groups[1].tokens_per_row) == (32, 4)
    assert plan.saved == (0, 1)


def test_transfer_disabled_group_is_skipped_not_blocking():
    plan = plan_groups([group(["a"], full()), group(["b"], full(), enable_kv_transfer=False)], DEFAULT)
    assert plan.saved == (0,)
    assert "enable_kv_transfer" in plan.skipped[1]
    assert plan.hits_allowed and not plan.multi_group


ALIGNED = 2 * BLOCK  # chunk size


def test_mamba_in_align_mode_is_saved_as_per_block_snapshots():
    plan = plan_groups([group(["a"], full()), group(["m"], mamba(mode="align"))], DEFAULT, ALIGNED)
    assert plan.saved == (0, 1) and plan.hits_allowed and plan.snapshot_groups == (1,)
    snapshot = plan.groups[1]
    assert (snapshot.block_size, snapshot.tokens_per_row, snapshot.is_state) == (1, BLOCK, True)
    assert plan.whole_chunks_only


def test_a_recurrent_only_model_saves_whole_chunks_only():
    plan = plan_groups([group(["m"], mamba(mode="align"))], DEFAULT, ALIGNED)
    assert plan.hits_allowed and not plan.multi_group and plan.whole_chunks_only


@pytest.mark.parametrize(("spec", "chunk_size", "message"), [
    (mamba(), ALIGNED, "mamba_cache_mode='align' (it is 'none'): start vLLM with enable_prefix_caching=True, "
                       "mamba_cache_mode='align'"),
    (mamba(mode="align"), BLOCK + 16,
     f"LMCache chunk_size {BLOCK + 16} is not a multiple of vLLM's block size {BLOCK} tokens: set chunk_size to a "
     f"multiple of {BLOCK}"),
    (mamba(mode="align", num_speculative_blocks=1), ALIGNED, "speculative decoding"),
    (mamba(mode="align"), 0, "LMCache chunk_size 0"),
])
def test_recurrent_state_stays_unrestorable_and_says_which_setting_to_change(spec, chunk_size, message):
    plan = plan_groups([group(["a"], full()), group(["m"], spec)], DEFAULT, chunk_size)
    assert plan.saved == (0,) and list(plan.unrestorable) == [1] and not plan.hits_allowed
    why = plan.why_no_hits()
    assert why.startswith("group 1 (MambaSpec): ") and message in why


def test_groups_failing_the_same_setting_are_named_in_one_reason():
    plan = plan_groups([group(["m0"], mamba()), group(["m1"], mamba()), group(["a"], full())], DEFAULT, ALIGNED)
    assert plan.why_no_hits() == (
        "groups 0, 1 (MambaSpec): recurrent state is kept per block only with mamba_cache_mode='align' (it is "
        "'none'): start vLLM with enable_prefix_caching=True, mamba_cache_mode='align'")


def test_any_step_budget_keeps_recurrent_groups_restorable():
    """The step budget is no setting of ours any more: states are saved where steps end (``state_ends``)."""
    plan = plan_groups([group(["m"], mamba(mode="align")), group(["a"], full())], DEFAULT, BLOCK)
    assert plan.hits_allowed and plan.snapshot_groups == (0,)


@pytest.mark.parametrize(("chunk_size", "blocks", "chosen", "line"), [
    (256, [256], 256, "chunk_size 256 equals vLLM's block; a chunk carries the state wherever a vLLM step ends "
                      "at its end"),
    (1088, [544], 1088, "chunk_size 1088 is 2 blocks of 544 tokens; a state is saved only where a vLLM step ends "
                        "on a chunk boundary (chunk_size 544 saves one at every step end)"),
    (256, [544], 544, "LMCache chunk_size 256 is not a multiple of vLLM's block of 544 tokens, where the states "
                      "are kept; using chunk_size 544"),
    (64, [96, 64], 192, "LMCache chunk_size 64 is not a multiple of vLLM's block of 192 tokens, where the states "
                        "are kept; using chunk_size 192"),
])
def test_chunk_size_for_recurrent_groups_is_a_multiple_of_their_block(chunk_size, blocks, chosen, line):
    got, said = chunk_size_for(chunk_size, blocks)
    assert (got, said) == (chosen, f"recurrent state groups: {line}")


# A prefill step over tokens [start, end): vLLM keeps real state blocks where the step ends and nulls (0) the
# blocks it skipped; block b holds the state after (b + 1) * 16 tokens.
@pytest.mark.parametrize(("table", "start", "end", "chunk", "ends"), [
    ([0, 0, 0, 7], 0, 64, 16, (64,)),  # one step of 4 blocks: only its end
    ([0, 0, 0, 7], 0, 64, 32, (64,)),
    ([0, 5, 0, 7], 0, 70, 16, (32, 64)),  # an internal checkpoint block beside the end's
    ([3, 0, 0, 7, 8], 16, 64, 16, (64,)),  # block 0 was an earlier step's: not this step's to save
    ([3, 4], 16, 24, 16, ()),  # a step ending mid-block ends at no boundary
    ([3, 4], 24, 32, 16, (32,)),  # a step from mid-block (vLLM stops it at the boundary) reaching it
    ([3, 4, 9], 47, 48, 16, (48,)),  # a decode step reaching a boundary
    ([3, 4], 0, 48, 16, (16, 32)),  # a table shorter than the step: no block, no state
])
def test_state_ends_are_the_chunk_ends_this_step_wrote(table, start, end, chunk, ends):
    assert state_ends([table], [16], start, end, chunk) == ends


def test_state_ends_need_every_snapshot_group():
    assert state_ends([[0, 1, 0, 2], [0, 0, 0, 3]], [16, 16], 0, 64, 16) == (64,)
    assert state_ends([[0, 1, 0, 2], [0, 4, 0, 0]], [16, 16], 0, 64, 16) == (32,)


def test_user_may_declare_a_group_unneeded():
    settings = PlatformSettings.load({"platforms.skip_groups": "MambaSpec"}, env={})
    plan = plan_groups([group(["a"], full()), group(["m"], mamba())], settings)
    assert plan.hits_allowed and plan.skipped == {1: "listed in platforms.skip_groups"}


def test_state_marker_skips_and_save_groups_overrides():
    class CompressorStateSpec(type(full())):
        pass

    state = CompressorStateSpec(block_size=32, num_kv_heads=1, head_size=64, dtype=full().dtype)
    groups = [group(["a"], full()), group(["s"], state)]
    assert plan_groups(groups, DEFAULT).saved == (0,)
    keep = PlatformSettings.load({"platforms.save_groups": "1"}, env={})
    assert plan_groups(groups, keep).saved == (0, 1)


def test_hybrid_manager_off_makes_one_full_attention_group_whatever_window_it_carries():
    """vLLM with its hybrid manager off promotes sliding layers to full attention and merges every layer into one
    group whose spec keeps the window: the group keeps every block and its full layers read every row, so a
    window-only store would leave stale rows there (the HMA-off wrong answers)."""
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs

    specs = {"full": full(), "slide0": sliding(48), "slide1": sliding(48)}
    unify_hybrid_kv_cache_specs(specs)
    merged = type(full()).merge(list(specs.values()))
    assert merged.sliding_window == 48  # what the group's spec says, though one layer is full attention
    plan = plan_groups([group(list(specs), merged)], DEFAULT)
    assert [g.sliding_window for g in plan.groups] == [None]
    assert plan.groups[0].kind.reach(plan.groups[0]) is None


def test_only_a_sliding_window_group_keeps_its_window():
    promoted = type(full())(block_size=32, num_kv_heads=1, head_size=64, dtype=full().dtype, sliding_window=48)
    plan = plan_groups([group(["a"], promoted), group(["b"], sliding(48))], DEFAULT)
    assert [g.sliding_window for g in plan.groups] == [None, 48]


def test_a_group_whose_layers_compress_differently_is_unrestorable_naming_them():
    """vLLM 0.32 groups DeepSeek-V4's 4- and 128-token compressed MLA layers together: one group geometry would
    move the 4-token layers' rows as if each covered 128 tokens."""
    names = ["model.layers.2.attn", "model.layers.3.attn", "model.layers.4.attn"]
    mixed = UniformTypeKVCacheSpecs(block_size=128, kv_cache_specs={
        names[0]: compressed(4), names[1]: compressed(128), names[2]: compressed(4)})
    plan = plan_groups([group(names, mixed)], PlatformSettings())
    assert plan.saved == ()
    assert plan.unrestorable == {0: "its layers store different tokens per row (4 tokens a row: model.layers.2.attn "
                                    "and 1 more; 128 tokens a row: model.layers.3.attn), which one group's rows "
                                    "cannot describe"}
    alike = UniformTypeKVCacheSpecs(block_size=128, kv_cache_specs={n: compressed(4) for n in names})
    assert plan_groups([group(names, alike)], PlatformSettings()).saved == (0,)
