"""Random layouts, not only the shipped examples, through a real ``LMCacheEngine``: store, wipe, retrieve, bit
for bit.

Each example draws a layout file (1-3 groups with sliding windows, compressed rows, state groups, snapshot
groups of recurrent state, non-power-of-two block and chunk sizes, padded or shared buffers, mixed dtypes), a
mode, a kernel backend, the paged connector (moving whole chunks, or layer by layer through a ``LayerGate``, our
vLLM integration's layerwise mode, the forward marking layers in a random order) or LMCache's layerwise connector
(any number of steps), and a request whose block
tables hold null blocks both where vLLM frees a sliding window's prefix and at random places (blocks vLLM's prefix cache
owns are passed as 0 too). The selftest oracle then demands that every row a stored chunk holds comes back
at its new slot, that no other row of any plane was written, and that LMCache hits exactly the tokens that
were stored (only whole chunks when several groups are saved). Because that oracle computes slots with
the connector's own code, a second check uses a brute-force model of docs/layouts.md's rules (row -> block id
-> slot, window tails, whole chunks, state groups skipped) on the raw allocations: each row is at its new
slot with its old bytes, and no other byte (padding, gaps) of any allocation was written.
"""

from __future__ import annotations

import dataclasses
import random
import threading
from collections.abc import Collection

import pytest
import torch
from hypothesis import assume, given
from hypothesis import strategies as st

from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.layout import LayoutSpec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.engine import LayoutEngine, StorageOptions, cache_size_gib
from lmcache_platforms.tools.fixtures import layout_over, materialize_tensors
from tests.layout.strategies import layout_specs

pytestmark = pytest.mark.slow


@st.composite
def cases(draw) -> tuple[LayoutSpec, str, str, str, int | str | None, int, list[list[bool]]]:
    """(layout file, mode, row unit, kernel backend, layerwise steps, ``"gated"`` or None for the paged connector,
    seed, per group: which blocks of the table are also null)."""
    spec = draw(layout_specs(every_group=True, min_chunks=1, snapshots=True))
    mode = draw(st.sampled_from(["bundled", "exploded"]))
    rows = draw(st.sampled_from(["tokens", "blocks"]))
    backend = draw(st.sampled_from(["auto", "torch"]))
    steps = draw(st.one_of(st.none(), st.just("gated"), st.integers(1, len(spec.layers))))
    seed = draw(st.integers(0, 2**16))
    nulls = [draw(st.lists(st.booleans(), min_size=blocks, max_size=blocks)) for blocks in spec.num_blocks]
    return spec, mode, rows, backend, steps, seed, nulls


def mark_in_order(gate: LayerGate, layers: tuple[str, ...], seed: int) -> None:
    """The forward's side: every layer marked written, in a random order."""
    order = list(layers)
    random.Random(seed).shuffle(order)
    for name in order:
        gate.mark(name)


def with_extra_nulls(request: roundtrip.Request, nulls: list[list[bool]]) -> roundtrip.Request:
    """The same request with more null blocks, at the same table positions for the store and the load."""
    def apply(tables: list[torch.Tensor]) -> list[torch.Tensor]:
        return [ids.masked_fill(torch.tensor(mask[: ids.numel()], dtype=torch.bool), 0)
                for ids, mask in zip(tables, nulls, strict=True)]

    return roundtrip.Request(request.tokens, request.stored_tokens, apply(request.store_ids), apply(request.load_ids))


def model_rows(spec: LayoutSpec, num_tokens: int, block_rows: Collection[int] = ()) -> dict[int, list[int]]:
    """Per saved group, the rows LMCache must hand back, by docs/layouts.md's rules alone: state groups are not
    saved unless they are snapshot groups; with several saved groups or a snapshot group only whole chunks
    are; a row belongs to the chunk holding its first token; a sliding-window group keeps the rows holding a
    token within the window before the chunk's end; a snapshot group keeps the snapshot taken at
    the chunk's end (row r = the state after (r + 1) x tokens_per_row tokens). A group moved in block rows
    (``block_rows``) keeps whole blocks: a window then keeps every row of the blocks holding one of its tokens."""
    saved = [g for g in spec.groups if g.snapshots or not (g.is_state or "State" in g.spec_name)]
    whole = len(saved) > 1 or any(g.snapshots for g in saved)
    stored = num_tokens - num_tokens % spec.chunk_size if whole else num_tokens
    out: dict[int, list[int]] = {}
    for g in saved:
        cr, rows = g.tokens_per_row, []
        for start in range(0, stored, spec.chunk_size):
            end = min(start + spec.chunk_size, stored)
            if g.snapshots:
                rows += [end // cr - 1]
                continue
            low = start if g.sliding_window is None else max(start, end - g.sliding_window)
            if g.index in block_rows:
                low -= low % (g.block_size * cr)
            rows += sorted({t // cr for t in range(low, end)})
        out[g.index] = rows
    return out


def slot(ids: torch.Tensor, block_size: int, row: int) -> int | None:
    """Where vLLM keeps ``row``: block ``ids[row // block_size]``, offset ``row % block_size``; None if null."""
    block = int(ids[row // block_size])
    return None if block == 0 else block * block_size + row % block_size


def check_against_model(spec: LayoutSpec, layout, request: roundtrip.Request,
                        before: dict[tuple[str, str], torch.Tensor], block_rows: Collection[int] = ()) -> None:
    """After store -> wipe (whole allocations) -> load: each model row is at its load slot with the bytes it
    had at its store slot, and every other byte of every allocation (rows, padding, gaps) is still zero.
    ``layout`` plans token rows (one per token or compressed row), whatever row unit the engine moved."""
    written = {key(s): torch.zeros_like(s, dtype=torch.uint8) for s in allocations(layout)}
    for group, rows in model_rows(spec, len(request.tokens), block_rows).items():
        size = spec.groups[group].block_size
        pairs = [(slot(request.store_ids[group], size, r), slot(request.load_ids[group], size, r)) for r in rows]
        pairs = [(src, dst) for src, dst in pairs if src is not None and dst is not None]
        for plane in (p for p in roundtrip.all_planes(layout) if p.group == group):
            per_block = plane.geometry.rows_per_block
            got, old = plane.rows_view(), before[(plane.layer, plane.name)]
            mask = dataclasses.replace(plane, storage=written[key(plane.storage)]).rows_view()
            for src, dst in pairs:
                assert torch.equal(got[dst // per_block, dst % per_block], old[src // per_block, src % per_block]), (
                    f"{plane.layer}/{plane.name}: slot {dst} does not hold what slot {src} held")
                mask[dst // per_block, dst % per_block] = 1
    for storage in allocations(layout):
        stray = torch.nonzero((storage != 0) & (written[key(storage)] == 0)).flatten()
        assert stray.numel() == 0, f"{stray.numel()} bytes written outside the model's rows, first at {int(stray[0])}"


def key(storage: torch.Tensor) -> int:
    """One allocation's identity (planes carved from one shared buffer each hold their own flat tensor)."""
    return storage.untyped_storage().data_ptr()


def allocations(layout) -> list[torch.Tensor]:
    """Each distinct allocation behind the layout's planes (saved or not) once."""
    seen: dict[int, torch.Tensor] = {}
    for plane in roundtrip.all_planes(layout):
        seen.setdefault(key(plane.storage), plane.storage)
    return list(seen.values())


@given(cases())
def test_random_layouts_round_trip_bit_exact(case) -> None:
    spec, mode, rows, backend, steps, seed, nulls = case
    tensors = materialize_tensors(spec, "cpu", seed)
    layout = layout_over(spec, tensors, mode, rows=rows)
    model = layout_over(spec, tensors, mode)
    assume(layout.transfer_groups)  # every group a state group: nothing is saved, vLLM gets no hits either
    request = with_extra_nulls(roundtrip.make_request(layout, spec.num_tokens, seed), nulls)
    if layout.whole_chunks_only:
        assert request.stored_tokens == spec.num_tokens // spec.chunk_size * spec.chunk_size
    before = {(p.layer, p.name): p.rows_view().clone() for p in roundtrip.all_planes(model)}
    storage = StorageOptions(max_local_cpu_size=cache_size_gib(layout, spec.num_tokens))
    layerwise = isinstance(steps, int)
    with LayoutEngine(layout, storage, kernel_backend=backend, layerwise=layerwise,
                      layer_steps=steps if layerwise else None) as engine:
        stored = roundtrip.snapshot(layout, request)
        moved = engine.connector.binding.moved_layers
        if steps == "gated":
            written = LayerGate(moved)
            marking = threading.Thread(target=mark_in_order, args=(written, moved, seed))
            marking.start()
            engine.store(request.tokens, request.store_ids, gate=written)
            marking.join()
        else:
            engine.store(request.tokens, request.store_ids)
        for allocation in allocations(layout):
            allocation.zero_()
        loaded = LayerGate(moved)
        hit = engine.retrieve(request.tokens, request.load_ids,
                              gate=loaded if steps == "gated" else None)
        verdict = roundtrip.verify(layout, request, stored, hit)
        chunks = -(-request.stored_tokens // spec.chunk_size)
        counters = engine.connector.binding.counters
        assert (counters.chunks_stored, counters.chunks_loaded) == (chunks, chunks if hit else 0)
        if steps is None:
            assert counters.launches == 2 * chunks * layout.launches_per_chunk
        group_bytes: dict[int, int] = {}
        for tg in layout.transfer_groups:  # what each vLLM KV-cache group's rows of the chunks hold
            group_bytes[tg.group] = group_bytes.get(tg.group, 0) + chunks * tg.bytes_per_chunk
        assert (counters.group_bytes_stored, counters.group_bytes_loaded) == (group_bytes, group_bytes if hit else {})
        if steps == "gated":
            layers = len(engine.connector.binding.layer_launches(engine.connector.fmt))
            assert (counters.layers_stored, counters.layers_loaded) == (layers, layers if hit else 0)
            assert all(loaded.wait(name, deadline=0.0)[0] for name in moved) == bool(hit)
            assert not loaded.released  # marked one by one by the load, not let through
    assert hit == request.stored_tokens
    assert verdict.bit_exact, verdict.problems  # the selftest's own oracle
    in_blocks = [g.index for g in layout.groups if g != model.group(g.index)]
    check_against_model(spec, model, request, before, in_blocks)  # and one that shares no slot or chunk code
