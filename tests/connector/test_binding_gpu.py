"""The connector's transfer path on a GPU, as it runs under LMCache: the kernels into a device scratch buffer on
the transfer stream (one launch per transfer group for the whole batch of chunks), one copy per chunk to pinned
host memory (LMCache's MemoryObjs), and back; whole chunks and layer by layer; bit-exact with the stored rows,
nothing else written; whole chunks hashed on the device to the host's checksum, a corrupt one refused before
any row is written. What ``make device-check`` adds to the kernel tests; CI has no GPU and skips.
"""

from __future__ import annotations

import pytest
import torch

from lmcache_platforms.connector import binding as binding_module
from lmcache_platforms.connector import checksum
from lmcache_platforms.connector.binding import LayoutBinding
from lmcache_platforms.connector.chunk_format import paged_format
from lmcache_platforms.layout.files import load_layout_spec
from lmcache_platforms.tools import roundtrip
from lmcache_platforms.tools.fixtures import materialize
from tests.kernels.test_triton_gpu import DEVICE, NO_GPU

pytestmark = pytest.mark.skipif(DEVICE is None, reason=NO_GPU)


def _store_and_load(layout_name: str, mode: str, plant_fault: bool, by_layer: bool = False,
                    fault_chunk: int = -1) -> roundtrip.Verdict:
    assert DEVICE is not None
    spec = load_layout_spec(layout_name)
    layout = materialize(spec, mode, device=DEVICE, seed=1)
    fmt = paged_format(layout)
    binding = LayoutBinding(layout, [fmt], "triton")
    assert binding.scratch, "a GPU layout is staged through device scratch buffers"
    request = roundtrip.make_request(layout, spec.num_tokens, seed=2)
    bounds = request.chunks(layout.chunk_size, request.stored_tokens)
    starts, ends = zip(*bounds, strict=True)
    hosts = [torch.zeros(fmt.nbytes, dtype=torch.uint8, pin_memory=True) for _ in bounds]
    steps = [launches for _, launches in binding.layer_launches(fmt)] if by_layer else [None]
    stripes = binding.integrity.store_stripes(fmt.payload_bytes, len(hosts), whole=not by_layer)
    with binding.streams.storing():
        slots = binding.chunk_slots(fmt, request.store_ids, starts, ends)
        for launches in steps:
            binding.store_chunks(fmt, hosts, slots, launches, stripes)
    binding.streams.finish_store()
    assert (stripes.room is not None) == (binding.integrity.on_device and not by_layer)
    stripes.seal(hosts)
    assert checksum.mismatched(hosts, fmt.payload_bytes) == [], "the device's stripe CRCs are the host's"
    stored = roundtrip.snapshot(layout, request)
    if plant_fault:
        hosts[fault_chunk][fmt.payload_bytes // 2] ^= 0xFF
    roundtrip.zero_planes(layout)
    slots = binding.chunk_slots(fmt, request.load_ids, starts, ends)
    if by_layer:
        with binding.streams.loading():
            for launches in steps:
                binding.load_chunks(fmt, hosts, slots, launches)
    else:
        assert binding.load_verified(fmt, hosts, slots) == ([fault_chunk % len(hosts)] if plant_fault else [])
    binding.streams.finish_load()
    assert binding.backend_names == ["triton"]
    return roundtrip.verify(layout, request, stored, request.stored_tokens)


@pytest.mark.parametrize("mode", ["bundled", "exploded"])
@pytest.mark.parametrize("layout_name", ["llama", "gemma3", "deepseek-v4-small", "qwen3-next", "mla-int8"])
def test_chunks_through_pinned_host_memory_come_back_bit_exact(layout_name, mode):
    verdict = _store_and_load(layout_name, mode, plant_fault=False)
    assert verdict.bit_exact, verdict.problems
    assert verdict.rows_checked > 0


@pytest.mark.parametrize("layout_name", ["gemma3", "deepseek-v4-small"])
def test_chunks_moved_layer_by_layer_come_back_bit_exact(layout_name):
    """vLLM's layerwise mode: each layer's pieces of every chunk in one call per piece, copied piece by piece."""
    verdict = _store_and_load(layout_name, "bundled", plant_fault=False, by_layer=True)
    assert verdict.bit_exact, verdict.problems
    assert verdict.rows_checked > 0


@pytest.mark.parametrize("run_bytes", [binding_module.HASH_RUN_BYTES, 1], ids=["runs", "object-by-object"])
@pytest.mark.parametrize("scratch_bytes", [binding_module.BATCH_SCRATCH_BYTES, 1], ids=["one-batch", "a-chunk-each"])
@pytest.mark.parametrize("fault_chunk", [0, -1], ids=["first", "last"])
def test_a_flipped_host_byte_is_refused_before_its_rows_are_written(scratch_bytes, fault_chunk, run_bytes,
                                                                    monkeypatch):
    """Each scratch-full is hashed on the device as it crosses (in runs of objects, or object by object) and
    checked before its own launches: with every chunk in one, or the corrupt chunk first, nothing is written
    (every stored row reads back as the zeros the planes were wiped to); with a chunk per scratch-full and the
    corrupt one last, the verified chunks before it are written, it is not."""
    monkeypatch.setattr(binding_module, "BATCH_SCRATCH_BYTES", scratch_bytes)
    monkeypatch.setattr(binding_module, "HASH_RUN_BYTES", run_bytes)
    verdict = _store_and_load("gemma3", "bundled", plant_fault=True, fault_chunk=fault_chunk)
    assert not verdict.bit_exact
    if scratch_bytes > 1 or fault_chunk == 0:
        assert verdict.mismatched_rows == verdict.rows_checked > 0, verdict.problems
    else:
        assert 0 < verdict.mismatched_rows < verdict.rows_checked, verdict.problems


def test_negative_control_one_flipped_byte_past_the_check_is_seen():
    """The byte flipped after the load's check (by layer, checked by no one here) reaches the planes, and the
    compare sees exactly its row."""
    verdict = _store_and_load("gemma3", "bundled", plant_fault=True, by_layer=True)
    assert not verdict.bit_exact
    assert verdict.mismatched_rows == 1, verdict.problems
