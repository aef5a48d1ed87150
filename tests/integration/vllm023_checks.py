"""Checks run under vLLM 0.23 (vllm-ascend's generation), in a subprocess with 0.23 first on the path.

0.23 names compression ``compress_ratio`` on MLA specs, has no ``enable_kv_transfer`` / ``tokens_per_state``,
and its scheduler records are the ones vllm-ascend sends; the tracker, the group plan and the per-step
metadata must read them the same way. Prints one JSON line; any failed assert exits non-zero.
"""

from __future__ import annotations

import json

import torch
import vllm
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec, SlidingWindowSpec

from lmcache_platforms.config import PlatformSettings
from lmcache_platforms.integration.vllm.groups import plan_groups
from lmcache_platforms.integration.vllm.request_meta import build_request_meta
from lmcache_platforms.integration.vllm.tracker import RequestTracker


def main() -> None:
    assert vllm.__version__.startswith("0.23"), vllm.__version__
    bf16 = torch.bfloat16
    groups = [
        KVCacheGroupSpec(["full"], FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=bf16)),
        KVCacheGroupSpec(["swa"], SlidingWindowSpec(block_size=128, num_kv_heads=1, head_size=64, dtype=bf16,
                                                    sliding_window=128)),
        KVCacheGroupSpec(["c4"], MLAAttentionSpec(block_size=128, num_kv_heads=1, head_size=512, dtype=bf16,
                                                  compress_ratio=4)),
    ]
    plan = plan_groups(groups, PlatformSettings())
    assert plan.saved == (0, 1, 2), plan.describe()
    assert [(g.block_size, g.tokens_per_row, g.sliding_window) for g in plan.groups] == \
        [(128, 1, None), (128, 1, 128), (32, 4, None)]

    new = NewRequestData(req_id="r", prompt_token_ids=list(range(300)), mm_features=[], sampling_params=None,
                         pooling_params=None, block_ids=([1, 2], [3, 4], [5, 6]), num_computed_tokens=0,
                         lora_request=None)
    tracker = RequestTracker.from_new_request(new, 3, 256, 0, False)
    cached = CachedRequestData(req_ids=["r"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[([7], [8], [9])], num_computed_tokens=[256], num_output_tokens=[0])
    tracker.append(list(range(256, 300)), cached.new_block_ids[0])
    assert tracker.block_ids == [[1, 2, 7], [3, 4, 8], [5, 6, 9]]
    meta = build_request_meta(tracker, plan, 64)
    assert meta is not None and meta.save_spec.num_tokens == 256
    assert meta.slot_mappings[2][:2].tolist() == [5 * 32, 5 * 32 + 1]  # compressed: 4 tokens per row
    assert meta.failed_blocks(200, 256) == {2, 4, 6}
    print(json.dumps({"vllm": vllm.__version__, "plan": plan.describe()}))


if __name__ == "__main__":
    main()
