"""The scheduler-side rules (``first_savable_token``, ``build_request_meta``, the tracker's append / resume /
roll-back, the load's ``blocks_not_held``) against a brute-force model of which chunks may and must be saved
and which blocks a load may write, over random groups, block tables and schedules.

The model is written from the docs (layouts, configuration, architecture), not from the code:
- a chunk carries, per saved group, the rows whose first token lies in it; a sliding-window group only those
  holding a token at or after ``chunk end - window``; a row lives in block ``table[row // block_size]``;
- a chunk may be saved only if every such row is in a real block (not vLLM's null block 0, not a block vLLM
  freed, and the block id the connector was told is the one vLLM holds);
- with several saved groups only whole chunks are saved; a partial chunk only for a single group, at the end
  of the prompt, when ``discard_partial_chunks`` is off; nothing is saved by a decode step unless
  ``save_decode_cache``; tokens are saved only once computed, under their own token ids;
- every whole chunk of the prompt whose rows are all real when it is computed must be in LMCache by the end
  of that step (the reason to offload at all);
- a load writes every row it restores into the request's own blocks and never into a block wholly inside
  vLLM's own prefix hit (shared with other requests) or a null block.

vLLM's side is simulated as its KV-cache manager behaves (vllm/v1/core/single_type_kv_cache_manager.py):
a sliding-window group's blocks wholly before ``computed - window + 1`` become null when a step is
scheduled (the connector is told only of new blocks, so its copy keeps the old ids), prefix hits pad those
blocks with nulls, a preempted request loses every block and comes back with a new table, and a failed load
rolls a single-group request back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from vllm.v1.core.sched.output import NewRequestData

from lmcache_platforms.integration.vllm.groups import GroupPlan
from lmcache_platforms.integration.vllm.request_meta import (
    LoadSpec,
    RequestMeta,
    build_request_meta,
    first_savable_token,
)
from lmcache_platforms.integration.vllm.tracker import RequestTracker
from lmcache_platforms.layout.groups import KVGroup
from lmcache_platforms.layout.slots import chunk_slots
from tests.integration.vllm_env import scheduler_output
from tests.layout.strategies import kv_groups

# ---------------------------------------------------------------------------------------------- the model


def carried_rows(group: KVGroup, start: int, end: int) -> list[int]:
    """Rows chunk ``[start, end)`` carries for ``group``: those holding its tokens (the window tail's for a
    sliding group); ``start`` is a row start, so each row is carried by the chunk holding its first token."""
    low = start if group.sliding_window is None else max(start, end - group.sliding_window)
    return sorted({t // group.tokens_per_row for t in range(low, end)})


def block_of(group: KVGroup, table: list[int], row: int) -> int:
    """The block id holding ``row``; 0 (null) when the table does not reach it."""
    index = row // group.block_size
    return table[index] if index < len(table) else 0


def chunk_savable(groups: list[KVGroup], tables: list[list[int]], start: int, end: int) -> bool:
    return all(block_of(g, tables[g.index], r) != 0 for g in groups for r in carried_rows(g, start, end))


def tokens_per_block(group: KVGroup) -> int:
    return group.block_size * group.tokens_per_row


def is_saved_group(group: KVGroup) -> bool:
    """docs/layouts.md: state groups (flag, or a spec name containing ``State``) are not saved by default."""
    return not (group.is_state or "State" in group.spec_name)


# ------------------------------------------------------------------------- first_savable_token, brute force


@st.composite
def tables_for(draw, groups: list[KVGroup], num_tokens: int) -> list[list[int]]:
    """Block tables with nulls anywhere, sometimes shorter than the tokens need (missing blocks read as null)."""
    out = []
    for g in groups:
        blocks = -(-num_tokens // tokens_per_block(g)) + draw(st.integers(-1, 1))
        out.append([draw(st.sampled_from([0, 1 + len(out) * 1000 + i])) for i in range(max(0, blocks))])
    return out


@given(st.data())
def test_first_savable_token_is_the_first_boundary_after_which_every_chunk_is_savable(data) -> None:
    groups, chunk = data.draw(kv_groups(max_groups=3))
    num_tokens = data.draw(st.integers(1, 5 * chunk))
    tables = data.draw(tables_for(groups, num_tokens))
    start = data.draw(st.integers(0, (num_tokens - 1) // chunk)) * chunk
    end = data.draw(st.sampled_from(sorted({num_tokens, num_tokens // chunk * chunk} - {0})))
    assume(start < end)
    boundaries = [*range(start, end, chunk), end]
    expected = next(b for b in boundaries if all(chunk_savable(groups, tables, c, min(c + chunk, end))
                                                 for c in range(b, end, chunk)))
    assert first_savable_token(groups, tables, start, end, chunk) == expected


# ------------------------------------------------------------------------------ a load, brute force


@given(st.data())
def test_a_load_writes_every_needed_row_and_never_a_block_vllm_holds(data) -> None:
    """The worker's path: ``blocks_not_held`` then each retrieved chunk's slots (as the connector computes
    them). Needed = rows of tokens in ``[vllm_cached, lmcache_cached)``, only the window's for sliding groups."""
    groups, chunk = data.draw(kv_groups(max_groups=3))
    saved = [g for g in groups if is_saved_group(g)]
    assume(saved)
    largest = max(tokens_per_block(g) for g in groups)
    lmcache = data.draw(st.integers(1, 4)) * chunk if len(saved) > 1 else data.draw(st.integers(1, 4 * chunk))
    vllm = data.draw(st.integers(0, lmcache // largest)) * largest
    assume(vllm < lmcache)
    tables = []
    for g in groups:  # vLLM's table after a hit of `lmcache` tokens: the window's prefix is null
        blocks = -(-lmcache // tokens_per_block(g))
        skipped = max(0, lmcache - g.sliding_window + 1) // tokens_per_block(g) if g.sliding_window else 0
        tables.append([0 if i < skipped else 100 * (g.index + 1) + i for i in range(blocks)])
    tracker = RequestTracker("r", lmcache + 5, list(range(lmcache + 5)), [list(t) for t in tables],
                             num_saved_tokens=lmcache)
    plan = GroupPlan(tuple(groups), tuple(g.index for g in saved))
    meta = build_request_meta(tracker, plan, chunk, load_spec=LoadSpec(vllm, lmcache, True))
    assert meta is not None and meta.token_ids[:lmcache] == list(range(lmcache))
    ids = meta.blocks_not_held(vllm)
    written: dict[int, set[int]] = {g.index: set() for g in saved}
    for start in range(vllm // chunk * chunk, lmcache, chunk):  # engine_impl masks chunks vLLM holds
        for g in saved:
            slots = chunk_slots(g, list(ids[g.index]), start, min(start + chunk, lmcache), chunk)
            written[g.index] |= {int(s) for s in slots if s >= 0}
    for g in saved:
        held = {b for i, b in enumerate(tables[g.index]) if (i + 1) * tokens_per_block(g) <= vllm}
        assert not {s // g.block_size for s in written[g.index]} & (held | {0})
        low = vllm if g.sliding_window is None else max(vllm, lmcache - g.sliding_window + 1)
        rows = {t // g.tokens_per_row for t in range(low, lmcache)}
        needed = {block_of(g, tables[g.index], r) * g.block_size + r % g.block_size for r in rows
                  if block_of(g, tables[g.index], r) != 0}
        assert needed <= written[g.index]


# ------------------------------------------------------------------------------ schedules, brute force


@dataclass
class Request:
    """vLLM's view of one request, its KV-cache manager's tables, and what LMCache holds (chunk ends)."""

    groups: list[KVGroup]
    prompt: list[int]
    max_outputs: int
    tokens: list[int] = field(default_factory=list)
    computed: int = 0
    true: list[list[int]] = field(default_factory=list)  # vLLM's tables (freed blocks are 0)
    told: list[list[int]] = field(default_factory=list)  # what the connector was told
    next_id: int = 1
    waiting: bool = True
    started: bool = False

    def allocate(self, upto: int, skipped_upto: int) -> list[list[int]]:
        """Null the window's skipped blocks, then give every group blocks up to token ``upto``; the new ids."""
        new = []
        for g, table in zip(self.groups, self.true, strict=True):
            if g.sliding_window is not None:
                skipped = max(0, skipped_upto - g.sliding_window + 1) // tokens_per_block(g)
                for i in range(min(skipped, len(table))):
                    table[i] = 0
            fresh = []
            while len(table) < -(-upto // tokens_per_block(g)):
                skipped = (g.sliding_window is not None
                           and (len(table) + 1) * tokens_per_block(g) <= skipped_upto - g.sliding_window + 1)
                fresh.append(0 if skipped else self.next_id)
                table.append(fresh[-1])
                self.next_id += 0 if skipped else 1
            new.append(fresh)
        return new


def lookup(lmcache: set[int], tokens: int, chunk: int) -> int:
    """LMCache's prefix lookup over ``tokens`` tokens: chunk after chunk until one is missing."""
    hit = 0
    for start in range(0, tokens, chunk):
        end = min(start + chunk, tokens)
        if end not in lmcache:
            break
        hit = end
    return hit


def stored_range(meta: RequestMeta | None, chunk: int) -> tuple[int, int]:
    """What ``wait_for_save`` stores for this metadata: ``[start, end)``, empty when nothing."""
    if meta is None or meta.save_spec is None or not meta.save_spec.can_save:
        return 0, 0
    return meta.save_spec.skip_leading_tokens // chunk * chunk, meta.save_spec.num_tokens


@st.composite
def scheduler_cases(draw):
    groups, chunk = draw(kv_groups(max_groups=3))
    saved = [g for g in groups if is_saved_group(g)]
    assume(saved)
    prompt = list(range(1000, 1000 + draw(st.integers(2, 4 * chunk))))
    return groups, saved, chunk, prompt, draw(st.integers(0, 2 * chunk)), draw(st.booleans()), draw(st.booleans())


def prefill_size(data, remaining: int) -> int:
    """Tokens a prefill step schedules: any number, one alone included (a scheduler's budget remainder)."""
    if remaining <= 1:
        return remaining
    return data.draw(st.integers(1, remaining))


class TrackerDriver:
    """The connector's scheduler side as ``MultiGroupConnectorImpl`` dispatches one request: a new request's
    tracker, ``resume`` for a preempted one, ``roll_back`` when vLLM computed fewer tokens than tracked, then
    ``append``; ``build_request_meta`` for the step."""

    def __init__(self, plan: GroupPlan, chunk: int, discard_partial: bool, save_decode: bool) -> None:
        self.plan, self.chunk, self.discard_partial, self.save_decode = plan, chunk, discard_partial, save_decode
        self.tracker: RequestTracker | None = None

    def step(self, kind: str, req: Request, n_before: int, scheduled: int, ids: list[list[int]],
             load_spec: LoadSpec | None) -> tuple[RequestMeta | None, RequestTracker]:
        if kind == "new":
            new = NewRequestData(req_id="r", prompt_token_ids=req.prompt, mm_features=[], sampling_params=None,
                                 pooling_params=None, block_ids=tuple(ids), num_computed_tokens=n_before,
                                 lora_request=None)
            self.tracker = RequestTracker.from_new_request(new, len(req.groups), n_before + scheduled,
                                                           load_spec.lmcache_cached_tokens, False)
        elif kind == "resumed":
            self.tracker.resume(req.tokens, tuple(ids), n_before, scheduled, load_spec.lmcache_cached_tokens)
        else:
            if n_before < len(self.tracker.token_ids):
                self.tracker.roll_back(n_before, req.tokens)
            base = min(n_before, len(self.tracker.token_ids))
            self.tracker.append(req.tokens[base : base + scheduled], tuple(ids))
        meta = build_request_meta(self.tracker, self.plan, self.chunk, load_spec=load_spec,
                                  discard_partial_chunks=self.discard_partial, save_decode_cache=self.save_decode)
        return meta, self.tracker

    def sampled(self, token: int) -> None:
        pass


def run_schedule(data, groups: list[KVGroup], saved: list[KVGroup], chunk: int, prompt: list[int],
                 max_outputs: int, discard_partial: bool, save_decode: bool, driver, hits: bool = True) -> None:
    """Drive one request through random vLLM steps and check every step's metadata against the model.

    ``hits=False``: LMCache is never asked (no lookups, so no loads and no roll-backs)."""
    multi = len(saved) > 1
    largest = max(tokens_per_block(g) for g in groups)
    seeded = data.draw(st.integers(0, len(prompt) // chunk)) if hits else 0  # stored by another request
    lmcache = {(k + 1) * chunk for k in range(seeded)}
    req = Request(groups, prompt, max_outputs, tokens=list(prompt), true=[[] for _ in groups])
    must_hold: set[int] = set()  # chunk ends the model requires in LMCache
    saved_mark = 0  # how far this request's tokens are known to LMCache (its hit, then its own saves)
    preemptions = rollbacks = 0
    for _ in range(60):
        n_before = req.computed
        total = len(req.tokens)
        load_spec = None
        kind = "running"
        if req.waiting:  # new, or resumed after preemption: prefix hits, a new table
            kind = "resumed" if req.started else "new"
            cap = total - 2 if total >= 2 else 0
            local = data.draw(st.integers(0, max(0, min(n_before if req.started else total, cap)) // largest)) * largest
            hit = lookup(lmcache, total, chunk) if hits else 0
            external = max(0, hit - local - (1 if hit == total else 0))
            load_spec = LoadSpec(local, hit, external > 0) if hits else None
            saved_mark = hit
            n_before = local + external
            req.true = [[] for _ in groups]
            req.allocate(n_before, n_before)  # prefix-hit blocks, nulls where the window skipped them
        remaining = total - n_before
        if remaining == 0:  # everything computed: a token is sampled, or the request ends
            if len(req.tokens) - len(prompt) >= max_outputs:
                break
            req.tokens.append(5000 + len(req.tokens))
            driver.sampled(req.tokens[-1])
            continue
        decode = n_before >= len(prompt) and remaining == 1
        scheduled = 1 if decode else prefill_size(data, remaining)
        n_after = n_before + scheduled
        new_ids = req.allocate(n_after, n_before)
        if kind == "running":
            for told, ids in zip(req.told, new_ids, strict=True):
                told.extend(ids)
        else:
            req.told = [list(t) for t in req.true]
        meta, tracker = driver.step(kind, req, n_before, scheduled, new_ids if kind == "running" else req.told,
                                    load_spec)
        req.started, req.waiting, req.computed = True, False, n_after
        # --- what the step asks the workers to do, against the model
        assert tracker.token_ids == req.tokens[:n_after]
        assert tracker.block_ids == req.told
        if meta is not None:
            assert meta.token_ids == req.tokens[: len(meta.token_ids)]
            assert [list(meta.block_ids[g.index]) for g in saved] == [req.told[g.index] for g in saved]
        if load_spec is not None and load_spec.can_load:
            assert meta is not None and meta.load_spec == load_spec
            assert len(meta.token_ids) >= load_spec.lmcache_cached_tokens
        start, end = stored_range(meta, chunk)
        if start < end:
            assert end <= n_after, "saves tokens not computed yet"
            assert not (decode and not save_decode), "a decode step saves"
            if end % chunk:
                assert not multi and not discard_partial and n_after >= len(prompt) and end == n_after
            for c in range(start, end, chunk):
                c_end = min(c + chunk, end)
                for g in saved:
                    for r in carried_rows(g, c, c_end):
                        index = r // g.block_size
                        assert index < len(req.true[g.index]) and req.true[g.index][index] != 0, (
                            f"chunk [{c}, {c_end}) row {r} of {g.describe()} is in a null or freed block")
                        assert req.told[g.index][index] == req.true[g.index][index]
                lmcache.add(c_end)
        # every whole prompt chunk computed by now whose rows are real at its completion must be held
        for c_end in range(chunk, min(n_after, len(prompt)) + 1, chunk):
            if c_end > n_before and chunk_savable(saved, req.true, c_end - chunk, c_end):
                must_hold.add(c_end)
        # "save once a chunk boundary is crossed": a step saving up to n handles every chunk below n (null
        # ones by skipping them); the prompt's partial last chunk (one group, no discard_partial_chunks) must
        # be saved by the step completing the prompt if that step crosses a boundary past the last handled.
        crossed = saved_mark == 0 or n_after // chunk > saved_mark // chunk
        partial = not multi and not discard_partial and n_after >= len(prompt)
        last = len(prompt) // chunk * chunk
        if (crossed and partial and n_before < len(prompt) == n_after and len(prompt) % chunk
                and chunk_savable(saved, req.true, last, len(prompt))):
            must_hold.add(len(prompt))
        if crossed and (save_decode or not decode):
            saved_mark = n_after if partial else n_after // chunk * chunk
        assert must_hold <= lmcache, f"chunks ending at {sorted(must_hold - lmcache)} were never saved"
        # --- what vLLM does next: preempt, fail a load (one full-attention group), or keep running
        if preemptions < 2 and data.draw(st.booleans()):
            preemptions += 1
            req.waiting, req.true = True, [[] for _ in groups]
        elif (load_spec is not None and load_spec.can_load and rollbacks < 1 and not multi
              and saved[0].sliding_window is None and data.draw(st.booleans())):
            rollbacks += 1
            lost = data.draw(st.integers(load_spec.vllm_cached_tokens // largest,
                                         (load_spec.lmcache_cached_tokens - 1) // largest)) * largest
            req.computed = lost
            saved_mark = min(saved_mark, lost)
            for c_end in [e for e in lmcache if e > lost]:
                lmcache.discard(c_end)
            must_hold = {e for e in must_hold if e <= lost}


@given(scheduler_cases(), st.data())
def test_saves_and_loads_over_random_schedules_match_the_model(case, data) -> None:
    groups, saved, chunk, prompt, max_outputs, discard_partial, save_decode = case
    plan = GroupPlan(tuple(groups), tuple(g.index for g in saved))
    driver = TrackerDriver(plan, chunk, discard_partial, save_decode)
    run_schedule(data, groups, saved, chunk, prompt, max_outputs, discard_partial, save_decode, driver)


class ConnectorDriver:
    """The same steps through the real scheduler-side ``LMCachePlatformsConnector`` and vLLM's own records
    (``Request``, ``NewRequestData``, ``CachedRequestData``, ``SchedulerOutput``): what vLLM hands it."""

    def __init__(self, connector, req_id: str, prompt: list[int]) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request as VllmRequest

        self.connector, self.req_id = connector, req_id
        self.request = VllmRequest(req_id, prompt, SamplingParams(max_tokens=4096), None)

    def step(self, kind: str, req: Request, n_before: int, scheduled: int, ids: list[list[int]],
             load_spec: LoadSpec | None) -> tuple[RequestMeta | None, RequestTracker]:
        from vllm.v1.core.sched.output import CachedRequestData

        self.request.num_computed_tokens = n_before
        if kind == "new":
            self.connector.update_state_after_alloc(self.request, None, 0)
            new = [NewRequestData.from_request(self.request, tuple(list(i) for i in ids))]
            out = scheduler_output(new=new, scheduled={self.req_id: scheduled})
        else:
            cached = CachedRequestData(
                req_ids=[self.req_id], resumed_req_ids={self.req_id} if kind == "resumed" else set(),
                new_token_ids=[[]], all_token_ids={}, new_block_ids=[tuple(list(i) for i in ids)],
                num_computed_tokens=[n_before], num_output_tokens=[self.request.num_output_tokens])
            out = scheduler_output(cached=cached, scheduled={self.req_id: scheduled})
        metas = {m.req_id: m for m in self.connector.build_connector_meta(out).requests}
        return metas.get(self.req_id), self.connector._impl._request_trackers[self.req_id]

    def sampled(self, token: int) -> None:
        self.request.append_output_token_ids(token)

    def finish(self) -> None:
        self.connector.build_connector_meta(scheduler_output(finished={self.req_id}))
        assert self.req_id not in self.connector._impl._request_trackers


@pytest.fixture(scope="module", params=["gemma3-like", "one-full-group"])
def scheduler_connector(request, model_dir):
    """A scheduler-side connector for a 4-group Gemma-3-like cache (window 64) or a single full-attention one."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheTensor

    from lmcache_platforms.integration.vllm.connector import LMCachePlatformsConnector
    from tests.integration.specs import full, gemma_like, group
    from tests.integration.vllm_env import vllm_config

    if request.param == "gemma3-like":
        kv_cache_config = gemma_like(window=64, num_blocks=4096)
    else:
        name = "model.layers.3.self_attn.attn"
        kv_cache_config = KVCacheConfig(num_blocks=4096, kv_cache_tensors=[KVCacheTensor(
            size=1, layers=[name], layer_stride=1, block_stride=1)], kv_cache_groups=[group([name], full())])
    connector = LMCachePlatformsConnector(vllm_config(model_dir, "LMCachePlatformsConnector"),
                                          KVConnectorRole.SCHEDULER, kv_cache_config)
    yield connector
    connector.shutdown()


_requests = iter(range(10**9))


@pytest.mark.slow
@given(st.data())
def test_the_real_scheduler_connector_follows_the_model(scheduler_connector, data) -> None:
    """The connector's own dispatch (``build_connector_meta``: new, running, resumed, roll-back detection,
    finished) over random schedules without LMCache hits: no lookups reach a worker here."""
    impl = scheduler_connector._impl
    groups = list(impl.plan.groups)
    saved = [groups[i] for i in impl.plan.saved]
    chunk = impl._lmcache_chunk_size
    prompt = list(range(1000, 1000 + data.draw(st.integers(2, 4 * chunk))))
    driver = ConnectorDriver(scheduler_connector, f"p{next(_requests)}", prompt)
    try:
        run_schedule(data, groups, saved, chunk, prompt, data.draw(st.integers(0, chunk)),
                     impl._discard_partial_chunks, impl.config.save_decode_cache, driver, hits=False)
    finally:
        driver.finish()


# ------------------------------------------------------------------------------ known disagreements


def test_a_one_token_prefill_step_does_not_stop_saving_the_prompt() -> None:
    group = KVGroup(index=0, block_size=16)
    plan = GroupPlan((group,), (0,))
    prompt = list(range(200))
    new = NewRequestData(req_id="r", prompt_token_ids=prompt, mm_features=[], sampling_params=None,
                         pooling_params=None, block_ids=([1, 2],), num_computed_tokens=0, lora_request=None)
    tracker = RequestTracker.from_new_request(new, 1, 31, 0, False)
    assert build_request_meta(tracker, plan, 64) is None  # 31 tokens: no whole chunk yet
    tracker.append(prompt[31:32], ([],))  # the budget left room for one token of this prefill
    tracker.append(prompt[32:128], ([3, 4, 5, 6, 7, 8],))
    meta = build_request_meta(tracker, plan, 64)
    assert meta is not None and meta.save_spec.can_save and meta.save_spec.num_tokens == 128


def test_a_partial_chunk_of_a_compressed_sliding_group_restores_the_whole_window() -> None:
    group = KVGroup(index=0, block_size=1, tokens_per_row=4, sliding_window=4)
    plan = GroupPlan((group,), (0,))
    tracker = RequestTracker("r", 9, list(range(9)), [[1, 2, 3]], num_saved_tokens=5)
    meta = build_request_meta(tracker, plan, 8, load_spec=LoadSpec(0, 5, True))
    assert meta is not None
    slots = chunk_slots(group, list(meta.blocks_not_held(0)[0]), 0, 5, 8)
    # resuming at token 5 attends to tokens 2..5: rows 0 (tokens 0-3) and 1 (tokens 4-7), slots 1 and 2
    assert slots.tolist() == [1, 2]
