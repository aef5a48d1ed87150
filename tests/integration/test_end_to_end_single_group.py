"""One KV-cache group (vLLM with the hybrid manager off) in the ``sync`` load mode: a load that comes back short
is reported through ``get_block_ids_with_load_errors`` and, once vLLM rolls the request back, recomputed and
stored again."""

from __future__ import annotations

import pytest
from vllm.v1.core.sched.output import CachedRequestData

from lmcache_platforms.integration.vllm.request_scope import SCOPE_TAG, request_scope
from tests.integration.test_end_to_end import PROMPT, admit, output
from tests.integration.vllm_stack import single_group_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single(model_dir):
    yield from single_group_stack(model_dir, **{"platforms.load_mode": "sync"})


def test_failed_blocks_are_reported_then_recomputed_and_stored_again(single):
    table_a, table_b = ([1, 2, 3, 4, 5, 6, 7],), ([8, 9, 10, 11, 12, 13, 14, 15],)
    hit, step = admit(single, "a", PROMPT, table_a)
    single.step(step, {"a": (PROMPT, table_a)})

    prompt_b = PROMPT[:192] + list(range(5000, 5040))
    hit, step = admit(single, "b", prompt_b, table_b)
    assert hit == 192
    engine, tags = single.worker.impl.lmcache_engine, single.worker.impl._key_tags
    configs = {SCOPE_TAG: request_scope(None, None), **tags}  # a plain request's keys
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=PROMPT[:192], request_configs=configs)]
    engine.storage_manager.remove(keys[-1])
    single.step(step, {})
    # tokens [128, 192) did not arrive: blocks 4 and 5 of b's table (32 tokens per block)
    assert single.worker.get_block_ids_with_load_errors() == {12, 13}
    assert single.worker.get_block_ids_with_load_errors() == set()

    # vLLM truncates b to its first failed block and recomputes from there; the lost chunk is stored again
    request_b = single.scheduler.impl._unfinished_requests["b"]
    request_b.num_computed_tokens = 128
    cached = CachedRequestData(req_ids=["b"], resumed_req_ids=set(), new_token_ids=[[]], all_token_ids={},
                               new_block_ids=[None], num_computed_tokens=[128], num_output_tokens=[0])
    step = output([], {"b": len(prompt_b) - 128}, sync_loads=False)
    step.scheduled_cached_reqs = cached
    single.step(step, {"b": (prompt_b, table_b)})
    hit, _ = admit(single, "d", PROMPT[:192] + [3] * 5, ([16, 17, 18, 19, 20, 21, 22],))
    assert hit == 192

