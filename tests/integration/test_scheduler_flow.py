"""The scheduler half of the connector against vLLM 0.32's real records (NewRequestData, CachedRequestData,
SchedulerOutput, KVCacheConfig, Request): what it tells the workers to save, step by step."""

from __future__ import annotations

import pytest
from vllm import SamplingParams
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData
from vllm.v1.request import Request, RequestStatus

from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
from tests.integration.specs import gemma_like
from tests.integration.vllm_env import BLOCK, vllm_config
from tests.integration.vllm_env import scheduler_output as output

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def connector(model_dir):
    conn = LMCachePlatformsConnector(vllm_config(model_dir, "LMCachePlatformsConnector"),
                                     KVConnectorRole.SCHEDULER, gemma_like(window=64, num_blocks=256))
    yield conn
    conn.shutdown()


class Blocks:
    """vLLM's one shared block pool: ids unique across groups, 0 is the null block."""

    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[int]:
        ids = list(range(self.next, self.next + n))
        self.next += n
        return ids

    def table(self, tokens: int, null_prefix: int = 0) -> tuple[list[int], ...]:
        n = -(-tokens // BLOCK)
        return (self.take(n), *([0] * null_prefix + self.take(n - null_prefix) for _ in range(3)))


def request(req_id: str, prompt: list[int]) -> Request:
    return Request(req_id, prompt, SamplingParams(max_tokens=8), None)


def new_data(req: Request, block_ids, computed: int = 0) -> NewRequestData:
    req.num_computed_tokens = computed
    return NewRequestData.from_request(req, block_ids)




def cached(entries, resumed=()) -> CachedRequestData:
    """entries: (request, new block ids or None)."""
    return CachedRequestData(
        req_ids=[r.request_id for r, _ in entries], resumed_req_ids=set(resumed), new_token_ids=[[]] * len(entries),
        all_token_ids={}, new_block_ids=[ids for _, ids in entries],
        num_computed_tokens=[r.num_computed_tokens for r, _ in entries],
        num_output_tokens=[r.num_output_tokens for r, _ in entries])


def admit(conn, req: Request) -> None:
    """What vLLM's scheduler does once blocks are allocated (no external tokens: these tests have no hits)."""
    conn.update_state_after_alloc(req, None, 0)


def by_id(meta) -> dict:
    return {r.req_id: r for r in meta.requests}


def test_requests_through_decode_preemption_abort_and_rollback(connector):
    pool = Blocks()
    a, b, c = request("a", list(range(1000, 1150))), request("b", list(range(40))), request("c", list(range(150)))
    tables = {"a": pool.table(150), "b": pool.table(40), "c": pool.table(150, null_prefix=1)}
    for req in (a, b, c):
        admit(connector, req)

    # Step 1: a whole prompt, b shorter than a chunk, c with 64 tokens already in vLLM's prefix cache.
    step = output(new=[new_data(a, tables["a"]), new_data(b, tables["b"]), new_data(c, tables["c"], 64)],
                  scheduled={"a": 150, "b": 40, "c": 86})
    metas = by_id(connector.build_connector_meta(step))
    assert sorted(metas) == ["a", "c"]  # b: nothing to save (no whole chunk), nothing to load
    ma = metas["a"]
    assert (ma.save_spec.can_save, ma.save_spec.skip_leading_tokens, ma.save_spec.num_tokens) == (True, 0, 128)
    assert ma.token_ids == a.prompt_token_ids[:128]
    assert ma.block_ids == tuple(tuple(ids) for ids in tables["a"])
    mc = metas["c"]
    # chunk [0, 64) of c has sliding-window rows in the null block: it must not be saved
    assert (mc.save_spec.skip_leading_tokens, mc.save_spec.num_tokens) == (64, 128)

    # Step 2: a decodes one token (nothing to save), b finished.
    a.num_computed_tokens = 150
    a.append_output_token_ids(7)
    step = output(cached=cached([(a, None)]), scheduled={"a": 1}, finished={"b"})
    assert connector.build_connector_meta(step).requests == []
    assert "b" not in connector._impl._request_trackers
    assert connector._impl._request_trackers["a"].token_ids[-1] == 7

    # Step 3: a was preempted and comes back with a new block table, recomputing everything.
    a.num_computed_tokens = 0
    new_table = pool.table(151)
    step = output(cached=cached([(a, new_table)], resumed={"a"}), scheduled={"a": 151})
    ma = by_id(connector.build_connector_meta(step))["a"]
    assert ma.block_ids == tuple(tuple(ids) for ids in new_table)
    assert (ma.save_spec.skip_leading_tokens, ma.save_spec.num_tokens) == (0, 128)

    # Step 4: vLLM rolled a back to 64 computed tokens (a failed load elsewhere): recompute and save again.
    tracker = connector._impl._request_trackers["a"]
    tracker.num_saved_tokens = 128
    a.num_computed_tokens = 64
    step = output(cached=cached([(a, None)]), scheduled={"a": 87})
    ma = by_id(connector.build_connector_meta(step))["a"]
    assert len(tracker.token_ids) == 151 and tracker.token_ids == a.all_token_ids[:151]
    assert (ma.save_spec.skip_leading_tokens, ma.save_spec.num_tokens) == (64, 128)

    # An aborted request: blocks can be freed at once, its tracker goes with the next step.
    d = request("d", list(range(70)))
    admit(connector, d)
    connector.build_connector_meta(output(new=[new_data(d, pool.table(70))], scheduled={"d": 70}))
    d.status = RequestStatus.FINISHED_ABORTED
    assert connector.request_finished_all_groups(d, pool.table(70)) == (False, None)
    connector.build_connector_meta(output(finished={"d", "a", "c"}))
    assert connector._impl._request_trackers == {}
