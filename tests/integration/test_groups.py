"""Which vLLM groups are saved, skipped (provably unneeded) or unrestorable (then no hits at all)."""

from __future__ import annotations

import pytest

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.groups import plan_groups, tokens_per_row
from lmcache_platforms.integration.vllm.recurrent import StepSettings
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


ALIGNED = StepSettings(chunk_size=2 * BLOCK, max_num_batched_tokens=BLOCK)


def test_mamba_in_align_mode_is_saved_as_per_block_snapshots():
    plan = plan_groups([group(["a"], full()), group(["m"], mamba(mode="align"))], DEFAULT, ALIGNED)
    assert plan.saved == (0, 1) and plan.hits_allowed and plan.snapshot_groups == (1,)
    snapshot = plan.groups[1]
    assert (snapshot.block_size, snapshot.tokens_per_row, snapshot.is_state) == (1, BLOCK, True)
    assert plan.whole_chunks_only


def test_a_recurrent_only_model_saves_whole_chunks_only():
    plan = plan_groups([group(["m"], mamba(mode="align"))], DEFAULT, ALIGNED)
    assert plan.hits_allowed and not plan.multi_group and plan.whole_chunks_only


@pytest.mark.parametrize(("spec", "steps", "message"), [
    (mamba(), ALIGNED, "mamba_cache_mode='align' (it is 'none'): start vLLM with enable_prefix_caching=True, "
                       "mamba_cache_mode='align'"),
    (mamba(mode="align"), StepSettings(BLOCK + 16, BLOCK),
     f"LMCache chunk_size {BLOCK + 16} is not a multiple of vLLM's block size {BLOCK} tokens: set chunk_size to a "
     f"multiple of {BLOCK}"),
    (mamba(mode="align"), StepSettings(2 * BLOCK, 2 * BLOCK),
     f"max_num_batched_tokens {2 * BLOCK} lets one prefill step span several {BLOCK}-token blocks, and vLLM keeps "
     f"the state only where a step ends: set max_num_batched_tokens below {2 * BLOCK} (e.g. {BLOCK})"),
    (mamba(mode="align", num_speculative_blocks=1), ALIGNED, "speculative decoding"),
    (mamba(mode="align"), None, "LMCache chunk_size 0"),
])
def test_recurrent_state_stays_unrestorable_and_says_which_setting_to_change(spec, steps, message):
    plan = plan_groups([group(["a"], full()), group(["m"], spec)], DEFAULT, steps)
    assert plan.saved == (0,) and list(plan.unrestorable) == [1] and not plan.hits_allowed
    why = plan.why_no_hits()
    assert why.startswith("group 1 (MambaSpec): ") and message in why


def test_groups_failing_the_same_setting_are_named_in_one_reason():
    plan = plan_groups([group(["m0"], mamba(mode="align")), group(["m1"], mamba(mode="align")),
                        group(["a"], full())], DEFAULT, StepSettings(2 * BLOCK, 4096))
    assert plan.why_no_hits() == (
        f"groups 0, 1 (MambaSpec): max_num_batched_tokens 4096 lets one prefill step span several {BLOCK}-token "
        f"blocks, and vLLM keeps the state only where a step ends: set max_num_batched_tokens below {2 * BLOCK} "
        f"(e.g. {BLOCK})")


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


def test_sliding_window_promoted_to_full_keeps_its_window():
    spec = type(full())(block_size=32, num_kv_heads=1, head_size=64, dtype=full().dtype, sliding_window=48)
    plan = plan_groups([group(["a"], spec), group(["b"], sliding(48))], DEFAULT)
    assert [g.sliding_window for g in plan.groups] == [48, 48]
