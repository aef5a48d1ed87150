"""The layerwise mode's pieces below vLLM: a chunk format cut by layer moves exactly the paged bytes (any layout,
any order of layers), and the gate that hands layers between the forward and a transfer."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from lmcache_platforms.connector import checksum
from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.connector.chunk_format import layer_launches, paged_format
from lmcache_platforms.connector.integrity import StoreStripes
from lmcache_platforms.connector.layer_gate import LayerGate
from lmcache_platforms.connector.paged import load_by_layer
from lmcache_platforms.kernels.contract import TransferError
from lmcache_platforms.kernels.crc32c import native
from lmcache_platforms.layout import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.fixtures import materialize
from tests.connector.test_chunk_checksum import _rows_of, assert_only_checked_rows, bound_request
from tests.layout.strategies import layout_specs


@given(layout_specs(every_group=True), st.sampled_from(["bundled", "exploded"]))
def test_layer_launches_tile_every_launch_by_layer_in_layer_order(spec, mode) -> None:
    layout = materialize(spec, mode, seed=0)
    fmt = paged_format(layout)
    order = layout.model_layers
    cut = layer_launches(fmt, order)
    names = [name for name, _ in cut]
    assert names == [name for name in order if name in names]
    pieces = sorted((p for _, launches in cut for p in launches), key=lambda p: p.offset)
    for name, launches in cut:
        assert all(plane.layer == name for piece in launches for plane in piece.planes)
    for launch in fmt.launches:
        inside = [p for p in pieces if launch.offset <= p.offset < launch.offset + launch.nbytes]
        assert [plane for p in inside for plane in p.planes] == list(launch.planes)
        assert all(p.tg is launch.tg for p in inside)
        ends = [launch.offset] + [p.offset + p.nbytes for p in inside]
        assert [p.offset for p in inside] == ends[:-1] and ends[-1] == launch.offset + launch.nbytes


def test_layer_launches_refuse_a_layer_outside_the_order() -> None:
    from lmcache_platforms.layout import load_layout_spec

    layout = materialize(load_layout_spec("gemma3"), seed=0)
    first = layout.model_layers[0]
    with pytest.raises(ValueError, match=rf"layers \['{first}'\] of the chunk format are not in the layer order"):
        layer_launches(paged_format(layout), layout.model_layers[1:])


def _planes(layout) -> list[torch.Tensor]:
    return [plane.rows_view().clone() for plane in roundtrip.all_planes(layout)]


@given(layout_specs(every_group=True, min_chunks=1, snapshots=True), st.sampled_from(["bundled", "exploded"]),
       st.randoms(use_true_random=False))
def test_moving_layer_by_layer_in_any_order_moves_the_paged_bytes(spec, mode, rng) -> None:
    layout = materialize(spec, mode, seed=rng.randrange(2**16))
    assume(layout.transfer_groups)
    fmt = paged_format(layout)
    binding = LayoutBinding(layout, [fmt], "torch")
    request = roundtrip.make_request(layout, spec.num_tokens, seed=rng.randrange(2**16))
    bounds = request.chunks(layout.chunk_size, request.stored_tokens)
    assume(bounds)
    cut = list(binding.layer_launches(fmt))
    rng.shuffle(cut)
    store_slots = binding.chunk_slots(fmt, request.store_ids, *zip(*bounds, strict=True))
    load_slots = binding.chunk_slots(fmt, request.load_ids, *zip(*bounds, strict=True))
    whole = [torch.zeros(fmt.nbytes, dtype=torch.uint8) for _ in bounds]
    binding.store_chunks(fmt, whole, store_slots)
    checksum.seal(whole, fmt.payload_bytes)
    by_layer = [torch.zeros_like(host) for host in whole]
    for _, launches in cut:
        binding.store_chunks(fmt, by_layer, store_slots, launches)
    checksum.seal(by_layer, fmt.payload_bytes)
    assert all(torch.equal(a, b) for a, b in zip(by_layer, whole, strict=True))

    roundtrip.zero_planes(layout)
    assert binding.load_verified(fmt, whole, load_slots) == []
    expected = _planes(layout)
    roundtrip.zero_planes(layout)
    for _, launches in cut:
        binding.load_chunks(fmt, whole, load_slots, launches)
    assert all(torch.equal(a, b) for a, b in zip(_planes(layout), expected, strict=True))

    # Negative control: one layer left out (when its bytes are not all zero) is seen by the same compare.
    name, launches = next(((n, ls) for n, ls in cut
                            if any(host[p.offset:p.offset + p.nbytes].any() for host in whole for p in ls)), (None, ()))
    if name is not None:
        roundtrip.zero_planes(layout)
        for other, pieces in cut:
            if other != name:
                binding.load_chunks(fmt, whole, load_slots, pieces)
        assert not all(torch.equal(a, b) for a, b in zip(_planes(layout), expected, strict=True))


def test_a_layer_the_gate_does_not_cover_is_ready_at_once_and_others_wait_until_marked() -> None:
    gate = LayerGate(["a", "b"])
    assert gate.wait("elsewhere", deadline=0.0) == (True, None)
    assert gate.wait("a", deadline=time.monotonic() + 0.01) == (False, None)
    event = object()
    gate.mark("a", event)
    assert gate.wait("a") == (True, event)
    assert gate.wait("b", deadline=time.monotonic()) == (False, None)


def test_release_ends_every_wait_of_the_gate() -> None:
    gate = LayerGate(["a"])
    results: list[tuple[bool, object]] = []
    waiter = threading.Thread(target=lambda: results.append(gate.wait("a")))
    waiter.start()
    gate.release()
    waiter.join(timeout=10)
    assert results == [(True, None)] and gate.released


def test_as_marked_yields_marked_layers_first_and_the_rest_in_order_once_released() -> None:
    gate = LayerGate(["a", "b", "c"])
    gate.mark("c", "event-c")
    taken = gate.as_marked(["a", "b", "c"])
    assert next(taken) == ("c", "event-c")
    got: list[tuple[str, object]] = []
    follower = threading.Thread(target=lambda: got.extend(taken))
    follower.start()
    gate.mark("b", "event-b")
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.001)
    assert got == [("b", "event-b")]  # "a" is not marked: it waits
    gate.release()
    follower.join(timeout=10)
    assert got == [("b", "event-b"), ("a", None)]


def test_a_load_gate_takes_one_pass() -> None:
    gate = LayerGate(["a"])
    gate.begin_pass()
    with pytest.raises(TransferError, match="a layerwise load moves all its chunks in one batched call; got a second"):
        gate.begin_pass()


def _stored(layout, seed: int):
    """A binding on the cpu kernels, and sealed host objects of a request's chunks with their load slots."""
    fmt = paged_format(layout)
    binding = LayoutBinding(layout, [fmt], "cpu")
    request = roundtrip.make_request(layout, layout.chunk_size * 3, seed=seed)
    bounds = request.chunks(layout.chunk_size, request.stored_tokens)
    hosts = [torch.zeros(fmt.nbytes, dtype=torch.uint8) for _ in bounds]
    stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=True)
    binding.store_chunks(fmt, hosts, binding.chunk_slots(fmt, request.store_ids, *zip(*bounds, strict=True)),
                         stripes=stripes)
    stripes.seal(hosts)
    return binding, fmt, hosts, binding.chunk_slots(fmt, request.load_ids, *zip(*bounds, strict=True))


def _marked(gate: LayerGate, binding: LayoutBinding) -> list[str]:
    return [name for name in binding.moved_layers if gate.wait(name, deadline=time.monotonic())[0]]


def _layer_rows_intact(layout, layers: list[str], intact: list[torch.Tensor]) -> bool:
    return all(torch.equal(now, good) for plane, now, good in zip(roundtrip.all_planes(layout), _rows_of(layout),
                                                                  intact, strict=True) if plane.layer in layers)


needs_native = pytest.mark.skipif(native() is None, reason="the native library is not built")


@needs_native
@settings(max_examples=25, deadline=None)
@given(layout_specs(every_group=True, min_chunks=3), st.sampled_from(["bundled", "exploded"]),
       st.randoms(use_true_random=False))
def test_a_gated_load_checks_each_layer_as_it_writes_it(spec, mode, rng) -> None:
    """Host objects through the gate (``load_by_layer``): intact, every layer marked and the planes as a whole
    verified load leaves them; with one flipped payload byte, that object named, no row holding a byte that
    failed its check, and each layer marked before the stop written whole."""
    layout = materialize(spec, mode, seed=rng.randrange(2**16))
    assume(layout.transfer_groups)
    binding, fmt, hosts, slots = _stored(layout, rng.randrange(2**16))
    assume(hosts)
    roundtrip.zero_planes(layout)
    assert binding.load_verified(fmt, hosts, slots) == []
    intact = _rows_of(layout)
    roundtrip.zero_planes(layout)
    gate = LayerGate(binding.moved_layers)
    assert load_by_layer(binding, fmt, hosts, slots, gate) == []
    assert _marked(gate, binding) == list(binding.moved_layers)
    assert all(torch.equal(a, b) for a, b in zip(_rows_of(layout), intact, strict=True))

    index = rng.randrange(len(hosts))
    hosts[index][rng.randrange(fmt.payload_bytes)] ^= 1 << rng.randrange(8)
    roundtrip.zero_planes(layout)
    gate = LayerGate(binding.moved_layers)
    assert load_by_layer(binding, fmt, hosts, slots, gate) == [index]
    assert_only_checked_rows(layout, intact)
    assert _layer_rows_intact(layout, _marked(gate, binding), intact)


@needs_native
def test_a_mismatch_in_the_last_layer_stops_the_load_after_the_layers_before_it() -> None:
    """No pass over the objects comes first: with the flipped byte in a stripe only the last layer's pieces need,
    the layers before it are written and marked (the forward may read them: verified bytes), then the load
    stops and names the object. Control: the same flip with the objects checked whole first marks no layer."""
    layout = materialize(load_layout_spec("qwen3-next"), "bundled", seed=3)
    binding, fmt, hosts, slots = _stored(layout, 5)
    cut = list(binding.layer_launches(fmt))
    last_name, last_pieces = cut[-1]
    start = max(piece.offset + piece.nbytes for piece in last_pieces) - 1
    stripe = start // checksum.STRIPE_BYTES
    assert all((piece.offset + piece.nbytes - 1) // checksum.STRIPE_BYTES < stripe
               for _, pieces in cut[:-1] for piece in pieces), "the last layer must own the last stripe"
    roundtrip.zero_planes(layout)
    assert binding.load_verified(fmt, hosts, slots) == []
    intact = _rows_of(layout)
    hosts[1][start] ^= 0x40
    roundtrip.zero_planes(layout)
    gate = LayerGate(binding.moved_layers)
    assert load_by_layer(binding, fmt, hosts, slots, gate) == [1]
    before = [name for name, _ in cut[:-1]]
    assert _marked(gate, binding) == before and last_name not in before
    assert _layer_rows_intact(layout, before, intact)
    assert_only_checked_rows(layout, intact)

    binding.integrity.in_copy = False
    roundtrip.zero_planes(layout)
    gate = LayerGate(binding.moved_layers)
    assert load_by_layer(binding, fmt, hosts, slots, gate) == [1]
    assert _marked(gate, binding) == []


@needs_native
@settings(max_examples=25, deadline=None)
@given(layout_specs(every_group=True, min_chunks=1), st.sampled_from(["bundled", "exploded"]),
       st.sampled_from(["cpu", "torch"]), st.randoms(use_true_random=False))
def test_a_layer_by_layer_store_hashes_its_pieces_in_any_order(spec, mode, backend, rng) -> None:
    """Stored a layer at a time in any order, each piece hashed as its kernels copy it (``store_stripes`` of
    pieces): the stripes of a pass over the finished objects, so ``seal`` writes the same trailer. Negative
    control: a byte changed between the store and the seal is not in them, so that object fails its check."""
    fmt, binding, bounds, slots = bound_request(spec, mode, backend, rng)
    cut = list(binding.layer_launches(fmt))

    def stored() -> tuple[list[torch.Tensor], StoreStripes]:
        hosts = [torch.zeros(fmt.nbytes, dtype=torch.uint8) for _ in bounds]
        stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=False)
        assert stripes.states is not None
        for _, launches in rng.sample(cut, len(cut)):
            binding.store_chunks(fmt, hosts, slots, launches, stripes)
        return hosts, stripes

    hosts, stripes = stored()
    passed = [host.clone() for host in hosts]
    stripes.seal(hosts)
    checksum.seal(passed, fmt.payload_bytes)
    assert all(torch.equal(a, b) for a, b in zip(hosts, passed, strict=True))
    assert checksum.mismatched(hosts, fmt.payload_bytes) == []

    hosts, stripes = stored()
    changed = rng.randrange(len(hosts))
    hosts[changed][rng.randrange(fmt.payload_bytes)] ^= 0x10
    stripes.seal(hosts)
    assert checksum.mismatched(hosts, fmt.payload_bytes) == [changed]
