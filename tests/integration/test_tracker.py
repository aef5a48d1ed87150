"""The multi-group request tracker against vLLM 0.32's real scheduler output records."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.output import NewRequestData

from lmcache_platforms.integration.vllm.tracker import RequestTracker, block_ids_per_group


def new_request(req_id: str, prompt: list[int], block_ids: tuple[list[int], ...], computed: int = 0):
    return NewRequestData(req_id=req_id, prompt_token_ids=prompt, mm_features=[], sampling_params=None,
                          pooling_params=None, block_ids=block_ids, num_computed_tokens=computed,
                          lora_request=None)


def test_block_id_shapes_of_every_generation():
    assert block_ids_per_group(([1, 2], [3]), 2) == [[1, 2], [3]]
    assert block_ids_per_group(None, 3) == [[], [], []]
    assert block_ids_per_group((), 2) == [[], []]
    assert block_ids_per_group([5, 6], 1) == [[5, 6]]
    with pytest.raises(ValueError, match="flat block id list for a model with 2"):
        block_ids_per_group([5, 6], 2)
    with pytest.raises(ValueError, match="block ids for 1 KV-cache groups, the model has 2"):
        block_ids_per_group(([1],), 2)


def test_new_running_resumed_and_rolled_back():
    prompt = list(range(100, 170))
    tracker = RequestTracker.from_new_request(new_request("r", prompt, ([1, 2], [0, 3])), 2, 64, 0, False)
    assert tracker.token_ids == prompt[:64] and tracker.block_ids == [[1, 2], [0, 3]]
    tracker.append(prompt[64:70], ([4], [5]))
    assert tracker.block_ids == [[1, 2, 4], [0, 3, 5]] and len(tracker.token_ids) == 70
    assert not tracker.is_decode_phase
    tracker.append([7], None)
    assert tracker.is_decode_phase and tracker.block_ids == [[1, 2, 4], [0, 3, 5]]
    all_ids = [*prompt, 7]
    tracker.resume(all_ids, ([9, 8, 7], [0, 0, 6]), num_computed_tokens=64, num_new_tokens=7,
                   lmcache_cached_tokens=64)
    assert tracker.block_ids == [[9, 8, 7], [0, 0, 6]]
    assert tracker.token_ids == all_ids and tracker.num_saved_tokens == 64
    tracker.roll_back(32, all_ids)
    assert tracker.token_ids == prompt[:32] and tracker.num_saved_tokens == 32


def test_a_new_request_keeps_every_fact_the_scheduler_gave():
    prompt = list(range(100, 170))
    configs = {"lmcache.tag.user": "u1"}
    tracker = RequestTracker.from_new_request(new_request("r", prompt, ([1, 2, 3], [0, 4, 5]), computed=32),
                                              2, 96, 64, True, configs)
    assert tracker == RequestTracker(req_id="r", prompt_len=70, token_ids=prompt, block_ids=[[1, 2, 3], [0, 4, 5]],
                                     num_saved_tokens=64, skip_save=True, request_configs=configs, step_start=32)


def test_a_resumed_request_starts_its_step_where_vllm_recomputes_and_knows_whether_it_decodes():
    prompt = list(range(100, 170))
    tracker = RequestTracker.from_new_request(new_request("r", prompt, ([1, 2, 3], [4, 5, 6])), 2, 70, 0, False)
    tracker.resume([*prompt, 7], ([9, 8, 7], [6, 5, 4]), num_computed_tokens=64, num_new_tokens=6,
                   lmcache_cached_tokens=0)
    assert (tracker.step_start, tracker.is_decode_phase, len(tracker.token_ids)) == (64, False, 70)
    tracker.resume([*prompt, 7], ([9, 8, 7], [6, 5, 4]), num_computed_tokens=70, num_new_tokens=1,
                   lmcache_cached_tokens=0)
    assert (tracker.step_start, tracker.is_decode_phase, len(tracker.token_ids)) == (70, True, 71)
